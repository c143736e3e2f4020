"""windowkit plans through SGLang's HTTP server (``python -m sglang.launch_server``) on CPU, serving SmolLM2-135M.

One server is started for this module as a subprocess on loopback (``cpu_engine.CPUServer``: the same CPU
arguments and environment as the live Engine of tests/test_sglang_live.py, ``--page-size 16``, the windowkit
linker as the dynamic external linker, the plugin loaded by SGLang's ``load_plugins()`` from its entry point).
The window is the live module's: chunks A, B, C of 64 tokens, A evicted, so ``[B, C]`` (8 pages) + a question.

* ``/generate`` with a plan in ``sampling_params.custom_params``: an exact plan answers with the server's own
  greedy ids for the same ids, with all 128 window tokens restored by the linker (its stats file);
* a blind plan reaches, through HTTP, the next-token KL to the server's own prefill that HFBackend predicts
  (within 1e-4; full-vocabulary log-probabilities);
* ``/v1/completions`` carries a plan in its ``custom_params`` too;
* a bad plan falls back (counted) and is answered by the server's own prefill;
* the OpenAI-style endpoints keep working for requests without a plan (``/v1/models``, ``/v1/completions``
  with the same greedy ids as ``/generate``, ``/v1/chat/completions``), and nothing is counted for them.

If the server cannot start, the tests fail with its log (never skipped).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _need import need  # noqa: E402

need("sglang", "make .venv/.windowkit-sglang-installed (pip install --no-deps -r requirements-sglang.txt "
               "-r requirements-sglang-engine.txt)")
for _mod, _pkg in (("jsonschema", "jsonschema"), ("soundfile", "soundfile"), ("python_multipart", "python-multipart")):
    need(_mod, f"pip install --no-deps {_pkg} (SGLang's HTTP server imports it; see docs/backends.md)")

from windowkit.backends.sglang import PLAN_KEY, linker_config, plan_request  # noqa: E402
from windowkit.backends.sglang.cpu_engine import CPUServer  # noqa: E402
from windowkit.chunk import Chunk  # noqa: E402
from windowkit.kv.metrics import kl_divergence  # noqa: E402
from windowkit.models import smollm2  # noqa: E402
from windowkit.window import Window  # noqa: E402

from sglang_helpers import CHUNK, NEW, PAGE, SmolWindow, running  # noqa: E402  (tests/sglang_helpers.py)

GREEDY = {"max_new_tokens": NEW, "temperature": 0.0}


class Served(SmolWindow):
    def __init__(self, tmp: Path):
        super().__init__(tmp)
        self.spool = str(tmp / "spool")
        os.makedirs(self.spool, exist_ok=True)
        self.srv = CPUServer.start(str(smollm2.checkpoint_dir()),
                                   linker=linker_config(self.hf.fingerprint(), str(self.stats_path)),
                                   log_path=str(tmp / "server.log"), page_size=PAGE)
        self._own = None

    def plan(self, mode: str, sampling_params: dict, **kw):
        """(plan, /generate body) for the ``mode`` window; exact plans are salted too (share_exact=False), so
        they never find the pages of the server's own prefill of the same ids."""
        win = self.window(mode)
        plan, req = plan_request(win.window_kv(), self.ids[1] + self.ids[2], self.q, page_size=PAGE,
                                 fingerprint=self.hf.fingerprint(), mode="exact" if mode == "exact" else "approx",
                                 spool_dir=self.spool, share_exact=False, sampling_params=sampling_params, **kw)
        assert req["input_ids"] == self.prompt
        return plan, req

    def own(self) -> dict:
        """The server's own /generate of [B, C, Q] (no plan): ``output_ids`` and ``text``."""
        if self._own is None:
            self._own = self.srv.post("/generate", {"input_ids": self.prompt, "sampling_params": GREEDY})
        return self._own

    def own_greedy(self) -> list[int]:
        return self.own()["output_ids"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from running(lambda: Served(tmp_path_factory.mktemp("sglang_server")),
                       "SGLang's HTTP server did not start on CPU; its reason", lambda sv: sv.srv.close())


def _delta(before: dict, after: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def test_exact_plan_over_http_generates_the_servers_own_greedy_ids(served):
    own = served.own_greedy()
    plan, req = served.plan("exact", GREEDY)
    assert plan.cache_salt is not None and PLAN_KEY in req["sampling_params"]["custom_params"]
    before = served.stats()
    out = served.srv.post("/generate", req)
    after = served.stats()
    assert out["output_ids"] == own and len(own) == NEW
    assert _delta(before, after, "plans") == 1 and _delta(before, after, "applied") == 1
    assert _delta(before, after, "tokens_restored") == 2 * CHUNK and _delta(before, after, "fallbacks") == 0
    assert out["meta_info"]["cached_tokens"] >= 2 * CHUNK


def test_blind_plan_over_http_reaches_the_kl_hf_predicts(served):
    exact = Window(served.hf, mode="exact")
    for name, ids in zip("BC", served.ids[1:]):
        exact.admit(Chunk.text(torch.tensor(ids), id=name))
    win = served.window("blind")
    kl_hf = kl_divergence(exact.forward(served.q), win.forward(served.q))
    one = {"max_new_tokens": 1, "temperature": 0.0}
    lp = {"return_logprob": True, "top_logprobs_num": served.vocab}
    ref = served.next_token_logprobs(served.srv.post("/generate", {"input_ids": served.prompt, "sampling_params": one, **lp}))
    _, req = served.plan("blind", one)
    before = served.stats()
    got = served.next_token_logprobs(served.srv.post("/generate", {**req, **lp}))
    after = served.stats()
    assert _delta(before, after, "applied") == 1 and _delta(before, after, "fallbacks") == 0
    kl_sg = kl_divergence(ref, got)
    print(f"\nblind over HTTP: KL predicted by HFBackend {kl_hf:.6g}, measured {kl_sg:.6g}")
    assert kl_hf > 1e-4 and abs(kl_sg - kl_hf) < 1e-4, (kl_hf, kl_sg)


def test_openai_completions_carry_a_plan_in_custom_params(served):
    """/v1/completions with token ids and the plan in ``custom_params``: restored by the linker, and the same
    greedy ids as /generate with the same plan."""
    served.srv.post("/flush_cache")  # the blind plan's pages from the test before are no longer in the tree
    _, req = served.plan("patch", GREEDY)
    by_generate = served.srv.post("/generate", req)["text"]
    served.srv.post("/flush_cache")
    body = {"model": "default", "prompt": req["input_ids"], "max_tokens": NEW, "temperature": 0.0,
            "custom_params": req["sampling_params"]["custom_params"], "cache_salt": req["cache_salt"]}
    before = served.stats()
    out = served.srv.post("/v1/completions", body)
    after = served.stats()
    assert _delta(before, after, "applied") == 1 and _delta(before, after, "fallbacks") == 0
    assert _delta(before, after, "tokens_restored") == 2 * CHUNK
    assert out["choices"][0]["text"] == by_generate


def test_bad_plan_over_http_falls_back_and_is_counted(served):
    own = served.own_greedy()
    req = {"input_ids": served.prompt, "cache_salt": f"wk-test-server-bad-{os.getpid()}",
           "sampling_params": {**GREEDY, "custom_params": {PLAN_KEY: "{not a plan"}}}
    before = served.stats()
    out = served.srv.post("/generate", req)
    after = served.stats()
    assert _delta(before, after, "fallbacks") == 1
    assert after["reasons"].get("bad_plan", 0) == before.get("reasons", {}).get("bad_plan", 0) + 1
    assert _delta(before, after, "applied") == 0
    assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == own


def test_openai_endpoints_work_without_a_plan(served):
    own = served.own()
    before = served.stats()
    models = served.srv.get("/v1/models")
    assert [m["id"] for m in models["data"]]
    out = served.srv.post("/v1/completions", {"model": models["data"][0]["id"], "prompt": served.prompt,
                                              "max_tokens": NEW, "temperature": 0.0})
    assert out["choices"][0]["text"] == own["text"]  # the same greedy answer as /generate
    assert out["usage"]["completion_tokens"] == len(own["output_ids"])
    chat = served.srv.post("/v1/chat/completions", {
        "model": models["data"][0]["id"], "max_tokens": 8, "temperature": 0.0,
        "messages": [{"role": "user", "content": "Name a colour."}]})
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["choices"][0]["message"]["content"]
    assert chat["usage"]["completion_tokens"] >= 1
    assert served.stats() == before  # no plan, nothing counted
