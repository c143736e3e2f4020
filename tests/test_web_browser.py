"""The web agent on real pages (agents/web_browser.py): a local site on loopback, rendered by headless Chromium.

Runs end to end in the browser: tiny random Qwen2.5-VL (screenshot + page text per observation, task + last 2
observations, ``KeywordPolicy``), 5 steps through the demo shop; and SmolLM2 (real weights, text only) choosing
the link itself. Ground truth: the pixels Chromium painted for the CSS served (header colours), the DOM text the
page holds, transformers' own forward of the model over the window's tokens (+ pixels), and the simulator replaying
the recorded trace against hand counts. Chromium must be installed (`make chromium`): the tests fail, never skip.
"""
from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from _need import need  # noqa: E402

need("PIL", "pip install pillow (in requirements.txt: make venv)")

from agents.long_video import byte_ids  # noqa: E402
from windowkit.kv.metrics import kl_divergence as _kl  # noqa: E402
from agents.web_browser import (CHATML, DEMO_TASK, BrowserAgent, BrowserError, Chromium, KeywordPolicy,  # noqa: E402
                                LocalSite, ModelPolicy, ScriptedPolicy, chromium_path, demo_site,
                                plot_run)
from windowkit.errors import WindowkitError  # noqa: E402

from model_helpers import model  # noqa: E402,F401  (module-scoped fixture, tests/model_helpers.py)

try:
    from vl_inputs import model_inputs
except ImportError:  # pragma: no cover
    from tests.vl_inputs import model_inputs

STEPS, WINDOW = 5, 2
VIEWPORT = (336, 224)  # multiples of patch x merge = 28: no rounding
SHOT_TOKENS = (336 // 28) * (224 // 28) + 2  # a merged 12 x 8 grid + vision start/end = 98
TEXT_TOKENS = 64
PATH = ["Tiny Shop", "Catalog", "Red lamp", "Your cart", "Order placed"]
HEADER_RGB = {"Tiny Shop": (0x2b, 0x4c, 0x9b), "Catalog": (0x21, 0x81, 0x4a), "Red lamp": (0xc0, 0x39, 0x2b),
              "Your cart": (0xd6, 0x89, 0x10), "Order placed": (0x7d, 0x3c, 0x98)}


def _chromium() -> str:
    try:
        return chromium_path()
    except BrowserError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def site():
    with LocalSite(demo_site(), max_requests=200, timeout_s=600) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with Chromium(viewport=VIEWPORT, executable=_chromium()) as b:
        yield b


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return tmp_path_factory.mktemp("trace") / "web_browser.jsonl"


@pytest.fixture(scope="module")
def run(model, site, browser, trace_path):
    agent = BrowserAgent(model, window=WINDOW, viewport=VIEWPORT, text_tokens=TEXT_TOKENS, reference=True,
                         record=trace_path)
    n0 = len(site.requests)
    report = agent.run(browser, site.url("/index.html"), DEMO_TASK, STEPS, KeywordPolicy(DEMO_TASK))
    report.requests = site.requests[n0:]  # what the browser fetched during the run
    return agent, report


# ---------------------------------------------------------------------- the site and the browser
def test_local_site_is_loopback_bounded_and_stops():
    with LocalSite({"/a.html": "<p>a</p>"}, max_requests=2, timeout_s=60) as s:
        assert s.url("/a.html").startswith("http://127.0.0.1:") and s._server.server_address[0] == "127.0.0.1"
        assert urllib.request.urlopen(s.url("/a.html"), timeout=10).read() == b"<p>a</p>"
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(s.url("/nope.html"), timeout=10)
        assert ei.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as ei:  # the third request is over budget
            urllib.request.urlopen(s.url("/a.html"), timeout=10)
        assert ei.value.code == 503
        assert s.stopped.wait(10)  # and the server stops itself
        assert s.requests == ["/a.html", "/nope.html"]
    with LocalSite({"/a.html": "a"}, timeout_s=0.2) as s:
        assert s.stopped.wait(10)  # its time budget ran out: stopped without being asked
    with pytest.raises(WindowkitError):
        LocalSite({"a.html": "a"})


def test_browser_that_cannot_start_names_the_install_step(tmp_path):
    with pytest.raises(BrowserError, match="apt-get install -y chromium"):
        Chromium(executable=str(tmp_path / "no-chromium"))
    fake = tmp_path / "fake-chromium"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(BrowserError, match=r"did not start .*exit code 3.*apt-get install -y chromium"):
        Chromium(executable=str(fake), timeout_s=20).start()


def test_browser_renders_the_served_pages(site, browser):
    obs = browser.observe(site.url("/lamp.html"), index=7)
    assert obs.title == "Red lamp" and obs.url == site.url("/lamp.html")
    assert "A red desk lamp with a warm bulb. Price: 12 EUR." in obs.text
    assert [(ln.label, ln.href) for ln in obs.links] == [("Add to cart", site.url("/cart.html")),
                                                          ("Catalog", site.url("/catalog.html"))]
    img = np.asarray(obs.screenshot)
    assert img.shape == (224, 336, 3)
    assert tuple(img[10, 200]) == HEADER_RGB["Red lamp"]  # the header's CSS colour, painted by Chromium
    ax = browser.observe(site.url("/lamp.html"), text="ax").text
    assert "link Add to cart" in ax and "link Catalog" in ax and "12 EUR" in ax
    with pytest.raises(BrowserError, match="cannot load"):  # nothing listens there
        browser.observe("http://127.0.0.1:9/index.html")
    with pytest.raises(BrowserError, match="cannot load"):  # every host but 127.0.0.1 resolves to nothing
        browser.observe("http://example.com/")


# ---------------------------------------------------------------------- the agent, end to end in the browser
def test_agent_follows_links_and_screenshots_differ(run):
    agent, report = run
    assert [r.title for r in report.steps] == PATH
    assert [r.chosen.label for r in report.steps] == ["Catalog", "Red lamp", "Add to cart", "Checkout", "Home"]
    shots = [np.asarray(r.screenshot) for r in report.steps]
    for i in range(len(shots)):
        assert tuple(shots[i][10, 200]) == HEADER_RGB[PATH[i]]
        for j in range(i):
            assert not np.array_equal(shots[i], shots[j]), (i, j)
    pages = [p for p in report.requests if p != "/favicon.ico"]
    assert pages == ["/index.html", "/catalog.html", "/lamp.html", "/cart.html", "/checkout.html"]
    # each observation's chunks: the screenshot (98 tokens) and the page text (byte ids of title + DOM text, cut)
    site_pages = demo_site()
    for r, obs in zip(report.steps, agent.observations):
        shot, text = obs
        assert (shot.id, text.id) == (f"shot-{r.index}", f"page-{r.index}") and len(shot) == SHOT_TOKENS
        assert shot.image_grid_thw.tolist() == [[1, 224 // 14, 336 // 14]]
        paragraph = site_pages[pages[r.index]].split("<p>")[1].split("</p>")[0]  # the served HTML's paragraph
        assert paragraph in r.text and r.text.startswith(r.title)  # innerText: header, then the paragraph
        assert text.input_ids.tolist() == byte_ids(f"\nPage: {r.title}\n{r.text}\n", 200)[:TEXT_TOKENS]
        assert len(text) == TEXT_TOKENS == r.page_tokens


def test_window_ops_match_the_steps(run):
    agent, report = run
    for r in report.steps:
        i = r.index
        held = [f"{kind}-{j}" for j in range(max(0, i - WINDOW + 1), i + 1) for kind in ("shot", "page")]
        assert r.held == held
        # assign's net edits: the new observation in, the one that fell out of the last k evicted. A step may
        # also take the prefix-cache route, evicting and re-admitting a survivor: then it appears in both lists.
        admitted, evicted = set(r.admitted) - set(r.evicted), set(r.evicted) - set(r.admitted)
        assert admitted == {f"shot-{i}", f"page-{i}"} | ({"task"} if i == 0 else set())
        assert evicted == ({f"shot-{i - WINDOW}", f"page-{i - WINDOW}"} if i >= WINDOW else set())
        assert r.delta["vision_calls"] == 1  # the new screenshot only: survivors never re-run the vision tower
        assert r.window_tokens == len(agent.task) + (min(i + 1, WINDOW)) * (SHOT_TOKENS + TEXT_TOKENS)
    assert agent.win.ids == ["task", "shot-3", "page-3", "shot-4", "page-4"]
    assert report.vision_calls == STEPS == agent.backend.stats.vision_calls
    tot = report.totals()
    for k in ("encodes", "patch_forms", "relocations", "prefill_tokens", "forwards"):
        assert tot[k] == report.stats[k], k


def _model_logits(model, chunks, query) -> torch.Tensor:
    """transformers' own forward over the chunks (input_ids + pixel_values + image_grid_thw, laid out as the
    processor lays images out) + the query: next-token logits."""
    from windowkit.chunk import Chunk

    kw = model_inputs(list(chunks) + [Chunk.text(torch.tensor(query), id="q")])
    model.model.rope_deltas = None
    with torch.no_grad():
        return model(**kw).logits[0, -1].float()


def test_window_equals_the_models_own_forward(run, model):
    """The query logits the policy read == the model's own forward over task + held observations + query. Exact on
    the admit-only steps (0, 1); after a slide the Window may keep survivors' KV (keep-as-is / repair, docs/window.md):
    measured KL 1e-13 with today's defaults (the step cap takes the exact prefix-cache route here), bounded at 0.1."""
    agent, report = run
    for r in report.steps:
        i = r.index
        chunks = [agent.task] + [c for obs in agent.observations[max(0, i - WINDOW + 1):i + 1] for c in obs]
        assert [c.id for c in chunks[1:]] == r.held
        kl = _kl(_model_logits(model, chunks, r.query), r.logits)
        assert kl < (1e-6 if i < WINDOW else 0.1), (i, kl)
        assert r.kl < (1e-6 if i < WINDOW else 0.1)  # and the exact-mode window agreed


def test_recorded_trace_replays_in_the_simulator(run, trace_path):
    from windowkit.trace import read_trace, simulate

    agent, report = run
    trace = read_trace(trace_path)
    assert agent.recorder is None and len(trace) == STEPS
    for st, r in zip(trace, report.steps):
        assert st.ids == ["task"] + r.held and st.query_tokens == r.query_tokens
        kinds = [(c.tokens, c.kind) for c in st.context[1:]]
        assert kinds == [(SHOT_TOKENS, "image"), (TEXT_TOKENS, "text")] * (len(r.held) // 2)
    res = simulate(trace, "cpu-tiny", strategies=["recompute", "windowkit"])
    # recompute prefills every step's whole window plus its query
    assert res.totals("recompute")["prefill_tokens"] == sum(r.window_tokens + r.query_tokens for r in report.steps)
    assert res.totals("windowkit")["prefill_tokens"] < res.totals("recompute")["prefill_tokens"]


def test_plot_and_bad_inputs(run, site, browser, model, trace_path, tmp_path):
    from PIL import Image

    from windowkit.trace import read_trace

    agent, report = run
    out = plot_run(report, read_trace(trace_path), tmp_path / "web.png", title="test")
    assert Image.open(out).size[0] > 600
    with pytest.raises(BrowserError, match="has no link"):
        BrowserAgent(model, window=1, viewport=VIEWPORT).run(browser, site.url("/index.html"), DEMO_TASK, 2,
                                                             ScriptedPolicy(["Nowhere"]))
    other = BrowserAgent(model, window=1, viewport=(280, 224))
    with pytest.raises(WindowkitError, match="viewport"):  # refused before the browser or the window is touched
        other.run(browser, site.url("/index.html"), DEMO_TASK, 1, KeywordPolicy(DEMO_TASK))
    assert other.win.ids == [] and other.backend.stats.vision_calls == 0
    for bad in (dict(window=0), dict(text="html"), dict(text_tokens=0)):
        with pytest.raises(WindowkitError):
            BrowserAgent(model, **bad)


# ---------------------------------------------------------------------- SmolLM2 chooses the link
def test_smollm2_chooses_the_link(site, browser):
    """SmolLM2-135M-Instruct (real weights) reads task + page text and picks the link; its per-label scores equal
    the mean log-probabilities from transformers' own forward over the same tokens."""
    need("gguf", "python -m pip install --no-deps -r requirements-real.txt (make test installs it)")
    from windowkit.models.load import load_model
    from windowkit.models import smollm2

    model = load_model("smollm2")
    tok = smollm2.load_tokenizer()

    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    agent = BrowserAgent(model, window=1, tokenize=enc, text_tokens=40, prompts=CHATML)
    assert agent.encoder is None and agent.viewport == VIEWPORT  # a text model: page text only, any viewport
    report = agent.run(browser, site.url("/index.html"), DEMO_TASK, 1, ModelPolicy())
    (r,) = report.steps
    assert r.delta["vision_calls"] == 0 and r.held == ["page-0"] and r.admitted == ["task", "page-0"]
    # ground truth: one batched forward of transformers over task + page + query + each label (right-padded)
    ctx = agent.task.input_ids.tolist() + agent.observations[0][0].input_ids.tolist()
    query = enc(CHATML.query.format(links=", ".join(dict.fromkeys(ln.label for ln in r.links))))
    assert query == r.query
    labels = list(r.scores)
    toks = [enc(CHATML.label.format(label=label)) for label in labels]
    width = max(len(t) for t in toks)
    batch = torch.tensor([ctx + query + t + [0] * (width - len(t)) for t in toks])
    with torch.no_grad():
        lp = model(input_ids=batch).logits.double().log_softmax(-1)
    n = len(ctx) + len(query)
    ref = {label: sum(float(lp[b, n - 1 + j, t]) for j, t in enumerate(tt)) / len(tt)
           for b, (label, tt) in enumerate(zip(labels, toks))}
    assert r.scores == pytest.approx(ref, abs=1e-3)
    assert r.chosen.label == max(ref, key=ref.get) == "Catalog"  # measured: -1.86 against Help -6.96, About us -6.73
    assert browser.observe(r.chosen.href).title == "Catalog"  # the link the model chose leads where it says


def test_example_runs(capsys, tmp_path):
    from examples.web_agent_browser import main

    png = tmp_path / "run.png"
    assert main(["--steps", "2", "--no-reference", "--plot", str(png), "--record", str(tmp_path / "w.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "Tiny Shop" in out and "Catalog" in out and "2 steps: vision calls 2" in out
    assert png.is_file() and (tmp_path / "w.jsonl").is_file()
