"""windowkit plans executed inside a live SGLang 0.5.23 Engine on CPU, serving SmolLM2-135M-Instruct.

One real ``sglang.Engine`` is started for this module (``windowkit.backends.sglang.cpu_engine``: a child
process with ``SGLANG_USE_CPU_ENGINE=1``, ``torch_native`` attention, fp32, ``sleep_on_idle``,
``max_total_tokens=16384``, ``context_length=4096``, page size 16) with ``WindowkitLinker`` as its dynamic
external linker and the windowkit plugin loaded by SGLang's own ``load_plugins()`` from the
``sglang.srt.plugins`` entry point (``SGLANG_PLUGINS=windowkit``). The same checkpoint folder is loaded by
``HFBackend``, which builds the windows and predicts their next-token KL.

The window: chunks A, B, C (64 tokens each, 4 pages) admitted, then A evicted, so the window is [B, C]
(128 tokens, 8 pages) and the query Q (10 tokens) follows it. SGLang prefills only Q; the linker writes the
8 pages from the plan. Checked:

* the plugin's hook ran in the scheduler (plans are registered only by it) and the linker restored every
  planned token (its stats file), with SGLang counting them as cached;
* an exact plan generates the same greedy ids as the engine's own prefill of the same ids;
* blind and patch plans reach, inside SGLang, the next-token KL to SGLang's own prefill that HFBackend
  predicts for the same window, within 1e-4 (full-vocabulary log-probabilities from the engine);
* each fallback prefills normally and is counted with its reason: a misaligned plan, a bad plan (not JSON;
  segments with a hole), a salt mismatch, a missing KV payload, another model's fingerprint: SGLang computes
  the whole prompt (``cached_tokens == 0``) and answers with its own prefill's greedy ids;
* the text agent (agents/text_reader.py, ``engine=``) answers through the engine, compared with exact
  re-prefill on transformers;
* a restarted engine reuses what a disk ChunkStore holds: the rebuilt window needs no encode, its KV is
  bitwise the first one's, and the new Engine restores it and answers as the first did (the test restarts
  the module's Engine, so it stays last).

If the Engine cannot start, every test fails with SGLang's reason (never skipped). Only this module starts
an Engine (twice: once, and once more for the restart); it takes 3-5 minutes on 2 busy cores (each start
40-90 s, each request a few seconds). ``WINDOWKIT_SGLANG_DEVICE=cuda`` runs the same tests with the Engine on
a GPU (scripts/gpu_check.sh).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch

from _need import need  # noqa: E402

need("sglang", "make .venv/.windowkit-sglang-installed (pip install --no-deps -r requirements-sglang.txt "
               "-r requirements-sglang-engine.txt)")

from windowkit.benchmarks import real_tasks  # noqa: E402
from windowkit.backends.sglang import PLAN_KEY, Segment, SGLangBackend, linker_config, plan_request  # noqa: E402
from windowkit.backends.sglang.cpu_engine import SHIM_DIR  # noqa: E402
from windowkit.chunk import Chunk  # noqa: E402
from windowkit.kv.metrics import kl_divergence  # noqa: E402
from windowkit.models import smollm2  # noqa: E402
from windowkit.store import ChunkStore  # noqa: E402
from windowkit.window import Window  # noqa: E402

from sglang_helpers import CHUNK, NEW, PAGE, SmolWindow, running  # noqa: E402  (tests/sglang_helpers.py)

# scripts/gpu_check.sh runs this module with WINDOWKIT_SGLANG_DEVICE=cuda: the same Engine host and tests, the
# Engine on one GPU with SGLang's own kernels (no stand-in); HFBackend stays on the CPU (fp32 reference)
DEVICE = os.environ.get("WINDOWKIT_SGLANG_DEVICE", "cpu")
SHIM_NAMES = ("copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu", "assign_extend_cache_locs_cpu",
              "assign_draft_cache_locs_contiguous_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
              "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu")


class Live(SmolWindow):
    """The running engine, the HF backend over the same folder, the token ids and the linker's stats."""

    def __init__(self, tmp: Path):
        super().__init__(tmp)
        assert all(len(x) == CHUNK for x in self.ids)
        self.log_path = tmp / "engine.log"
        os.makedirs(tmp / "spool", exist_ok=True)
        # share_exact=False: an exact plan gets a salt too, so it never finds the pages the engine's own
        # prefill of the same ids left in the radix tree (the comparison would restore nothing)
        self.sg = SGLangBackend.launch_cpu(str(smollm2.checkpoint_dir()), self.hf, page_size=PAGE,
                                           spool_dir=str(tmp / "spool"), stats_path=str(self.stats_path),
                                           log_path=str(self.log_path), share_exact=False, device=DEVICE)
        self.engine = self.sg.engine
        self._ref_lp = None
        self._own = None

    def restart(self, tmp: Path) -> None:
        """Shut the Engine down and start a fresh one (empty radix tree, a new linker and plan registry)."""
        self.sg.shutdown()
        self.stats_path = tmp / "linker_stats_restarted.json"
        self.sg = SGLangBackend.launch_cpu(str(smollm2.checkpoint_dir()), self.hf, page_size=PAGE,
                                           spool_dir=self.sg.spool_dir, stats_path=str(self.stats_path),
                                           log_path=str(tmp / "engine_restarted.log"), share_exact=False,
                                           device=DEVICE)
        self.engine = self.sg.engine

    def logprob_request(self) -> dict:
        return {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
                "top_logprobs_num": self.vocab}

    def own_greedy(self) -> list[int]:
        """SGLang's own greedy ids for [B, C, Q] (no plan)."""
        if self._own is None:
            sp = {"max_new_tokens": NEW, "temperature": 0.0}
            self._own = list(self.engine.generate(input_ids=self.prompt, sampling_params=sp)["output_ids"])
        return self._own

    def reference_logprobs(self) -> torch.Tensor:
        """SGLang's own prefill of [B, C, Q] (no plan)."""
        if self._ref_lp is None:
            self._ref_lp = self.next_token_logprobs(self.engine.generate(input_ids=self.prompt, **self.logprob_request()))
        return self._ref_lp


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    yield from running(lambda: Live(tmp_path_factory.mktemp("sglang_live")),
                       "the SGLang Engine did not start on CPU; SGLang's reason", lambda lv: lv.sg.shutdown())


def _load_shim():
    spec = importlib.util.spec_from_file_location("windowkit_sgl_kernel_shim", SHIM_DIR / "sgl_kernel" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------- the sgl_kernel stand-in (no engine)
def test_shim_defines_only_the_names_sglang_imports_and_each_raises():
    shim = _load_shim()
    public = sorted(n for n in dir(shim) if not n.startswith("_") and n not in ("SHIM", "annotations"))
    assert public == sorted(SHIM_NAMES) and sorted(shim.__all__) == sorted(SHIM_NAMES)
    for name in SHIM_NAMES:
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} was called"):
            getattr(shim, name)()
    # every name is one that SGLang's sources import from sgl_kernel (none is dead weight)
    import sglang

    root = Path(sglang.__file__).parent
    src = "\n".join(p.read_text(errors="replace") for p in list(root.glob("kernels/ops/**/*.py"))
                    + list(root.glob("srt/mem_cache/*.py")))
    for name in SHIM_NAMES:
        assert re.search(rf"from sgl_kernel import[^\n]*\b{name}\b|from sgl_kernel import \([^)]*\b{name}\b", src), name


# ---------------------------------------------------------------------- the live engine
def test_engine_runs_on_the_shim_with_the_plugin_from_its_entry_point(live):
    info = live.engine.info
    assert info["sglang"] == "0.5.23"
    if DEVICE == "cpu":
        assert info["sgl_kernel_is_shim"] and Path(info["sgl_kernel"]).is_relative_to(SHIM_DIR)
    else:  # on a GPU: SGLang's own kernels, never the stand-in
        assert not info["sgl_kernel_is_shim"] and not Path(info["sgl_kernel"]).is_relative_to(SHIM_DIR)
    assert "windowkit=windowkit.backends.sglang.plugin:register" in info["plugins"]


def test_exact_plan_generates_the_engines_own_greedy_ids(live):
    own = live.own_greedy()
    before = live.stats()
    out = live.sg.serve(live.window("exact"), live.q, sampling_params={"max_new_tokens": NEW, "temperature": 0.0})
    assert out["output_ids"] == own and len(own) == NEW
    after = live.stats()
    # the plugin hook (only it registers plans) ran inside SGLang's scheduler; the linker wrote all 8 pages
    assert after["plans"] == before.get("plans", 0) + 1
    assert after["applied"] == before.get("applied", 0) + 1
    assert after["tokens_restored"] - before.get("tokens_restored", 0) == 2 * CHUNK
    assert after["fallbacks"] == before.get("fallbacks", 0)
    assert out["meta_info"]["cached_tokens"] >= 2 * CHUNK  # SGLang prefilled only the query


def test_the_engine_attends_from_the_new_rows_only(live):
    """The plugin's row-only extend attention (extend_rows.py) runs in the engine: a request whose window is
    restored computes attention for its new rows only; the linker's stats (dumped at each plan event, so a
    request's own forward shows at the next one) count the padded rows SGLang's CPU fallback would add."""
    sp = {"max_new_tokens": 1, "temperature": 0.0}
    live.sg.serve(live.window("exact"), live.q, sampling_params=sp)
    s1 = live.stats()["extend_rows"]
    # an unparsable plan: a counted fallback (whose dump carries the counts) and a full prefill, no radix pages
    live.engine.generate(input_ids=live.prompt, rid=_fresh_salt("rows-rid"), cache_salt=_fresh_salt("rows"),
                         sampling_params=dict(sp, custom_params={PLAN_KEY: "{not a plan"}))
    s2 = live.stats()["extend_rows"]
    layers = live.hf.model.config.num_hidden_layers
    assert s2["calls"] - s1["calls"] >= layers
    assert s2["rows_skipped"] - s1["rows_skipped"] >= layers * 2 * CHUNK  # the restored window's rows


@pytest.mark.parametrize("mode", ["blind", "patch"])
def test_approximate_plan_reaches_the_kl_hf_predicts(live, mode):
    """KL(SGLang prefill || SGLang with the window restored from the plan) equals HFBackend's
    KL(exact window || the same window) within 1e-4."""
    exact = Window(live.hf, mode="exact")
    for name, ids in zip("BC", live.ids[1:]):
        exact.admit(Chunk.text(torch.tensor(ids), id=name))
    win = live.window(mode)
    kl_hf = kl_divergence(exact.forward(live.q), win.forward(live.q))
    ref = live.reference_logprobs()
    # the two engines agree on the exact distribution to begin with
    assert kl_divergence(exact.forward(live.q), ref) < 1e-6
    before = live.stats()
    out = live.sg.serve(win, live.q, **live.logprob_request())
    after = live.stats()
    assert after["applied"] == before.get("applied", 0) + 1 and after["fallbacks"] == before.get("fallbacks", 0)
    assert live.sg.last_plan.cache_salt is not None  # approximate pages live in a namespace of their own
    kl_sg = kl_divergence(ref, live.next_token_logprobs(out))
    assert kl_hf > 1e-4 if mode == "blind" else True  # blind reuse really is approximate here
    print(f"\n{mode}: KL predicted by HFBackend {kl_hf:.6g}, measured in SGLang {kl_sg:.6g}, |diff| {abs(kl_sg - kl_hf):.2g}")
    assert abs(kl_sg - kl_hf) < 1e-4, (mode, kl_hf, kl_sg)


def test_misaligned_plan_falls_back_to_sglangs_prefill_and_is_counted(live):
    """A plan whose segment boundary is not on a page (B's first 60 tokens exact, the rest approximate):
    the plugin refuses it (misaligned), counts it once, and SGLang answers with its own prefill."""
    win = live.window("blind")
    plan, kw = plan_request(win.window_kv(), live.ids[1] + live.ids[2], live.q, page_size=PAGE,
                            fingerprint=live.hf.fingerprint(), spool_dir=live.sg.spool_dir,
                            segments=[Segment(0, 60, "exact", "B"), Segment(60, 2 * CHUNK, "approx", "C")],
                            sampling_params={"max_new_tokens": NEW, "temperature": 0.0})
    assert plan.cache_salt is not None and kw["input_ids"] == live.prompt
    before = live.stats()
    out = live.engine.generate(**kw)
    after = live.stats()
    assert after["plans"] == before.get("plans", 0) + 1
    assert after["fallbacks"] == before.get("fallbacks", 0) + 1
    assert after["reasons"].get("misaligned", 0) == before.get("reasons", {}).get("misaligned", 0) + 1
    assert after["applied"] == before.get("applied", 0)
    assert out["meta_info"]["cached_tokens"] == 0  # its own salt: nothing cached, the whole prompt prefilled
    assert out["output_ids"] == live.own_greedy()


# ---------------------------------------------------------------------- the other fallbacks
_salts = iter(range(10**6))


def _fresh_salt(what: str) -> str:
    """A namespace no earlier request used: SGLang's radix tree holds nothing in it, so the whole prompt is
    prefilled (``cached_tokens == 0``) unless the linker restores it."""
    return f"wk-test-{what}-{os.getpid()}-{next(_salts)}"


def _blind_request(live, **kw):
    """A blind window's plan for [B, C] + Q (greedy, NEW tokens); ``kw`` goes to ``plan_request``."""
    win = live.window("blind")
    args = dict(page_size=PAGE, fingerprint=live.hf.fingerprint(), spool_dir=live.sg.spool_dir,
                sampling_params={"max_new_tokens": NEW, "temperature": 0.0})
    args.update(kw)
    plan, req = plan_request(win.window_kv(), live.ids[1] + live.ids[2], live.q, **args)
    assert req["input_ids"] == live.prompt
    return plan, req


def _assert_falls_back(live, req: dict, reason: str, *, registered: bool = True) -> dict:
    """Send ``req``: the linker restores nothing, the fallback is counted once with ``reason``, SGLang
    prefills the whole prompt itself and answers exactly as its own prefill of the same ids."""
    own = live.own_greedy()
    before = live.stats()
    out = live.engine.generate(**req)
    after = live.stats()
    b_reasons = before.get("reasons", {})
    assert after["fallbacks"] == before.get("fallbacks", 0) + 1, (before, after)
    assert after["reasons"].get(reason, 0) == b_reasons.get(reason, 0) + 1, (reason, after["reasons"])
    assert sum(after["reasons"].values()) == sum(b_reasons.values()) + 1  # one reason, once
    assert after.get("applied", 0) == before.get("applied", 0)
    assert after.get("tokens_restored", 0) == before.get("tokens_restored", 0)
    assert after.get("plans", 0) == before.get("plans", 0) + (1 if registered else 0)
    assert out["meta_info"]["cached_tokens"] == 0  # nothing restored, nothing reused: a full prefill
    assert out["output_ids"] == own
    return out


@pytest.mark.parametrize("bad", ["not-json", "gap"])
def test_bad_plan_falls_back_to_sglangs_prefill_and_is_counted(live, bad):
    """A plan the hook cannot use: not JSON at all, or segments that leave a hole in the window. The
    request runs as if it carried no plan (a salt of its own, so SGLang computes every token)."""
    if bad == "not-json":
        plan_json = "{windowkit plan, truncated"
    else:
        plan, _ = _blind_request(live, segments=[Segment(0, 48, "approx", "B"), Segment(64, 2 * CHUNK, "approx", "C")])
        d = plan.to_json()
        assert d["segments"][0]["stop"] != d["segments"][1]["start"]  # [48, 64) is in no segment
        plan_json = json.dumps(d)
    req = {"input_ids": live.prompt, "rid": _fresh_salt("bad-rid"), "cache_salt": _fresh_salt("bad"),
           "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "custom_params": {PLAN_KEY: plan_json}}}
    # an unparsable plan is refused before it is registered; a parsed one is registered, then refused
    _assert_falls_back(live, req, "bad_plan", registered=bad != "not-json")


def test_salt_mismatch_falls_back_to_sglangs_prefill_and_is_counted(live):
    """An approximate plan sent under another explicit cache_salt than its own: its pages would land in a
    namespace other requests share, so the hook refuses it."""
    plan, req = _blind_request(live)
    assert plan.cache_salt is not None
    req["cache_salt"] = _fresh_salt("other-tenant")
    _assert_falls_back(live, req, "salt_mismatch")


def test_missing_kv_falls_back_to_sglangs_prefill_and_is_counted(live):
    """The plan's payload file is gone by the time the scheduler looks for it."""
    # per-chunk segments: a salt (and payload file) of its own, not the plan the KL test left in the tree
    plan, req = _blind_request(live, segments=[Segment(0, CHUNK, "approx", "B"), Segment(CHUNK, 2 * CHUNK, "approx", "C")])
    assert Path(plan.kv_ref).is_file()
    os.remove(plan.kv_ref)
    _assert_falls_back(live, req, "kv_missing")


def test_another_models_plan_falls_back_to_sglangs_prefill_and_is_counted(live):
    """A plan made for another model (its fingerprint is not the linker's): never written into this pool."""
    plan, req = _blind_request(live, fingerprint="another-model:" + live.hf.fingerprint()[:16])
    assert plan.fingerprint != live.hf.fingerprint() and plan.cache_salt is not None
    _assert_falls_back(live, req, "fingerprint_mismatch")


# ---------------------------------------------------------------------- the text agent on the live engine
AGENT_STEPS, AGENT_K = 3, 3


def test_text_agent_answers_through_the_live_engine(live):
    """agents/text_reader.py with ``engine=``: each step's window (patch mode) is restored into SGLang from its
    plan and SGLang answers; exact re-prefill (transformers) is the reference, as without an engine."""
    from agents.text_reader import TextReaderAgent, format_table, make_log

    agent = TextReaderAgent(live.hf.model, live.tok, k=AGENT_K, engine=live.sg)
    before = live.stats()
    report = agent.run(make_log(seed=0, steps=AGENT_STEPS, k=AGENT_K, n_filler=2, lookback_every=2, reach=1))
    after = live.stats()
    table = format_table(report)
    print("\n" + table)
    assert len(report.steps) == AGENT_STEPS and any(r.kind == "look-back" for r in report.steps)
    assert after["applied"] - before.get("applied", 0) == AGENT_STEPS  # every step's plan was restored
    assert after["fallbacks"] == before.get("fallbacks", 0)
    for row in report.steps:
        whole_pages = len(row.window_ids) // PAGE * PAGE
        assert row.engine_cached >= whole_pages  # SGLang prefilled only the partial page and the question
        assert row.tokens < row.exact_tokens
        assert real_tasks.first_number(row.pc_answer) == real_tasks.first_number(row.exact_answer)
    s = report.summary()
    # measured: see docs/backends.md; the bounds leave one flip for a near-tie, as tests/test_text_agent.py does
    assert s["same_as_exact"] >= AGENT_STEPS - 1, table
    assert s["kl_mean"] < 0.05, table


# ---------------------------------------------------------------------- a restarted engine (keep last: it restarts)
def test_restarted_engine_reuses_the_store_without_re_encoding(live, tmp_path_factory):
    """A disk ChunkStore filled while the first Engine served a window; the Engine is restarted (empty radix
    tree, new linker); a new Window over the same store builds the same window with no encode and no
    prefill, and the new Engine, restoring it from the plan, answers as the first one did."""
    tmp = tmp_path_factory.mktemp("sglang_restart")
    fp = live.hf.fingerprint()
    sp = {"max_new_tokens": NEW, "temperature": 0.0}

    def window(store):
        w = Window(live.hf, store=store, mode="blind")
        for name, ids in zip("ABC", live.ids):
            w.admit(Chunk.text(torch.tensor(ids), id=name))
        w.evict("head")
        return w

    store = ChunkStore(tmp / "store", model_fingerprint=fp, layout=live.hf.layout)
    w1 = window(store)
    kv1 = w1.window_kv()
    assert w1.stats.encodes == 3
    first = live.sg.serve(w1, live.q, sampling_params=sp)
    salt1 = live.sg.last_plan.cache_salt
    store.close()

    live.restart(tmp)
    assert live.stats() == {}  # a new scheduler: nothing counted yet

    store = ChunkStore(tmp / "store", model_fingerprint=fp, layout=live.hf.layout)
    w2 = window(store)
    kv2 = w2.window_kv()
    assert w2.stats.encodes == 0 and w2.stats.prefill_tokens == 0 and w2.stats.forwards == 0  # nothing re-encoded
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv1.layers, kv2.layers))
    out = live.sg.serve(w2, live.q, sampling_params=sp)
    assert live.sg.last_plan.cache_salt == salt1
    after = live.stats()
    assert after["plans"] == 1 and after["applied"] == 1 and after["fallbacks"] == 0
    assert after["tokens_restored"] == 2 * CHUNK  # restored by the linker: the new radix tree was empty
    assert out["meta_info"]["cached_tokens"] >= 2 * CHUNK
    assert out["output_ids"] == first["output_ids"]
    store.close()
