"""`windowkit simulate --out` reports and `windowkit calibrate`: the numbers in summary.json and the HTML table are
checked against costs computed by hand (the trace and profile of tests/test_simulate.py), the plots are opened as
images, and report.html is rendered by headless Chromium (Debian's `chromium`; .ci/run installs it)."""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess

import pytest
from PIL import Image, ImageStat

from windowkit import cli
from windowkit.trace import load_profile, simulate, sliding_window
from windowkit.trace.report import PLOTS, downsample, rolling_mean, timeline, timeline_image, write_report

from hand_trace import A, B, C, P, T  # noqa: E402  (tests/hand_trace.py)
# totals worked out step by step in tests/test_simulate.py
HAND = {
    "recompute": {"total_ms": 56, "prefill_tokens": 24, "encodes": 0, "patch_forms": 0, "patch_applies": 0,
                  "relocations": 0, "bytes_peak": 10 * 100},
    "radix": {"total_ms": 34, "prefill_tokens": 18, "encodes": 0, "patch_forms": 0, "patch_applies": 0,
              "relocations": 0, "bytes_peak": 16 * 100},
    "blind": {"total_ms": 34, "prefill_tokens": 12, "encodes": 0, "patch_forms": 0, "patch_applies": 0,
              "relocations": 4, "bytes_peak": 20 * 100},
    "blend": {"total_ms": 36, "prefill_tokens": 14},
    # the Window's defaults (lazy forming, "balanced" repair): tests/test_simulate.py::test_windowkit
    "windowkit": {"total_ms": 34.0, "prefill_tokens": 18, "encodes": 2, "patch_forms": 0, "patch_applies": 0,
                  "relocations": 0, "bytes_peak": (4 + 2 + 2 + 4 + 10) * 100},
    # A, B, C prefilled once (10 tokens) + queries 1, 1, 0; vision A, C once (16 ms); holds the 10 distinct tokens
    "floor": {"total_ms": 28, "prefill_tokens": 12, "encodes": 0, "patch_forms": 0, "patch_applies": 0,
              "relocations": 0, "bytes_peak": 10 * 100},
}
REQUIRED = ("total_ms", "prefill_tokens", "encodes", "patch_forms", "patch_applies", "relocations", "bytes_peak")


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:  # not a skip: the report test is part of the suite
        pytest.fail("headless Chromium is needed to test report.html: install Debian's package "
                    "(`apt-get update && apt-get install -y chromium`; .ci/run does this when it is missing)")
    return exe


def _run_chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    res = simulate(T, P, progress=False)
    return res, write_report(res, out, trace=T)


def test_summary_json_holds_the_hand_computed_totals(report):
    res, paths = report
    s = json.loads(paths["summary"].read_text())
    assert s["steps"] == 3 and s["profile"] == "unit" and list(s["strategies"]) == list(HAND)
    for name, want in HAND.items():
        got = s["strategies"][name]
        assert set(REQUIRED) <= set(got), name
        for k, v in want.items():
            assert got[k] == pytest.approx(v), (name, k)
        assert got == pytest.approx(res.totals(name)), name  # and the rest is the SimResult's own totals
    assert s["ratios"]["windowkit/recompute"] == pytest.approx(34 / 56)
    # per-step series: recompute pays 15, 15, 26 ms; the trace serves 6, 6, 10 context tokens + 1, 1, 0 query
    assert s["per_step"]["recompute"]["total_ms"] == [15, 15, 26]
    assert s["per_step"]["blind"]["relocations"] == [0, 1, 3]
    assert s["context_tokens_per_step"] == [6, 6, 10] and s["query_tokens_per_step"] == [1, 1, 0]


def test_plots_are_real_images(report):
    _, paths = report
    assert set(PLOTS) <= set(paths)
    for key in PLOTS:
        with Image.open(paths[key]) as im:
            assert im.format == "PNG" and im.width >= 600 and im.height >= 300, key
            colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colours is not None and len(colours) > 50, key  # lines, text, antialiasing: not one colour


def test_timeline_downsample_and_rolling_mean_by_hand():
    ids, cells = timeline([[A, B], [B, C], [A, B, C]])
    assert ids == ["A", "B", "C"]
    assert cells == [(0, 0, 0), (0, 1, 1), (1, 1, 0), (1, 2, 1), (2, 0, 0), (2, 1, 1), (2, 2, 2)]
    img, n = timeline_image([[A, B], [B, C]])
    assert n == 3 and img.shape == (3, 2)
    assert [[None if v != v else v for v in row] for row in img.tolist()] == [[0, None], [1, 0], [None, 1]]
    img, _ = timeline_image([[A, B], [B, C]], height=1)  # all chunks binned into one row: the largest slot shows
    assert img.tolist() == [[1, 1]]
    assert downsample([1, 2, 3, 4, 5, 6], 3) == ([0.5, 2.5, 4.5], [1.5, 3.5, 5.5])
    assert downsample([1, 2, 3, 4, 5], 2) == ([1.0, 3.5], [2.0, 4.5])  # bins of ceil(5/2) = 3 steps
    assert downsample([7, 8], 5) == ([0.0, 1.0], [7.0, 8.0])
    assert rolling_mean([2, 4, 6, 8], 2) == [2.0, 3.0, 5.0, 7.0]


def test_html_is_self_contained_and_holds_the_table(report):
    _, paths = report
    page = paths["html"].read_text()
    assert "http" not in page and "<link" not in page and "<script" not in page and "url(" not in page
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == len(PLOTS)
    for key, src in zip(PLOTS, srcs):  # each plot embedded byte for byte
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]) == paths[key].read_bytes()
    row = re.search(r"<tr><th>recompute</th>(.*?)</tr>", page).group(1)
    assert "<td>56.0</td>" in row and "<td>1.000</td>" in row and "<td>24</td>" in row


def test_chromium_renders_the_report(report, tmp_path):
    _, paths = report
    url = paths["html"].resolve().as_uri()
    dom = _run_chromium(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert '<table id="summary">' in dom.stdout
    rows = dict(re.findall(r"<tr><th>(\w+)</th>(.*?)</tr>", dom.stdout))
    assert "<td>56.0</td>" in rows["recompute"] and "<td>34.0</td>" in rows["radix"]
    assert "<td>0.607</td>" in rows["windowkit"]  # 34 / 56 vs recompute
    shot = tmp_path / "shot.png"
    r = _run_chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,2000", url)
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    with Image.open(shot) as im:
        rgb = im.convert("RGB")
        assert rgb.size == (1200, 2000)
        assert ImageStat.Stat(rgb.convert("L")).stddev[0] > 20  # not blank
        grey = rgb.convert("L").point(lambda v: 255 if v < 200 else 0)
        assert grey.histogram()[255] > 0.02 * 1200 * 2000  # text, table rules and plots cover the page
        hsv = rgb.convert("HSV").split()
        coloured = Image.eval(hsv[1], lambda v: 255 if v > 120 else 0).histogram()[255]
        assert coloured > 2000  # the plots' coloured lines rendered (the table alone is black on white)


def test_recorded_orders_win_over_the_trace(tmp_path):
    res = simulate(T, P, strategies=["recompute"], progress=False)
    res.orders = [[B, A], [C, B], [C, B, A]]  # as a placement policy may have replayed them
    s = json.loads(write_report(res, tmp_path, trace=T)["summary"].read_text())
    assert s["context_tokens_per_step"] == [6, 6, 10] and s["query_tokens_per_step"] == [1, 1, 0]
    from windowkit.trace.report import _orders

    assert [[c.id for c in o] for o in _orders(T, 3, res)[0]] == [["B", "A"], ["C", "B"], ["C", "B", "A"]]


def test_report_without_trace_and_long_run(tmp_path):
    res = simulate(T, P, strategies=["recompute"], progress=False)
    paths = write_report(res, tmp_path / "short")  # the result records its orders: a timeline without the trace
    assert "window_timeline" in paths and "cost_per_step" in paths
    res.orders, res.queries = [], []  # a result that recorded nothing and no trace: no timeline, no error
    paths = write_report(res, tmp_path / "bare")
    assert "window_timeline" not in paths and "cost_per_step" in paths
    trace = sliding_window(steps=2100, k=3)  # > 2000 steps: binned plots, no per-step series in the JSON
    res = simulate(trace, P, strategies=["recompute", "blind"], progress=False)
    paths = write_report(res, tmp_path / "long", trace=trace)
    s = json.loads(paths["summary"].read_text())
    assert s["steps"] == 2100 and s["per_step"] is None and "per_step_omitted" in s
    # recompute prefills every context token and every query token of every step
    assert s["strategies"]["recompute"]["prefill_tokens"] == sum(st.tokens + st.query_tokens for st in trace)
    with Image.open(paths["cost_per_step"]) as im:
        assert im.width >= 600


def test_cli_simulate_out(tmp_path, capsys):
    out = tmp_path / "rep"
    rc = cli.main(["simulate", "sliding-3", "--max-steps", "30", "--profile", "cpu-tiny", "--out", str(out),
                   "--no-progress"])
    assert rc == 0
    assert f"report: {out / 'report.html'}" in capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 30 and s["profile"] == "cpu-tiny"
    assert list(s["strategies"]) == ["recompute", "radix", "blind", "blend", "windowkit", "floor"]
    steps = list(sliding_window())[:30]  # the generator's defaults, as the CLI builds it
    assert s["strategies"]["recompute"]["prefill_tokens"] == sum(st.tokens + st.query_tokens for st in steps)
    assert len(s["per_step"]["windowkit"]["total_ms"]) == 30
    for key in PLOTS:
        assert (out / f"{key}.png").stat().st_size > 5000


def test_cli_calibrate_writes_a_loadable_profile(tmp_path, capsys):
    path = tmp_path / "sub" / "prof.json"
    assert cli.main(["calibrate", "--tokens", "64", "--repeats", "1", "--out", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "prefill_ms_per_token" in printed and str(path) in printed
    prof = load_profile(path)
    assert prof.name.startswith("calibrated-") and "tokens=64" in prof.source and "repeats=1" in prof.source
    assert prof.prefill_ms_per_token > 0 and prof.vision_encode_ms_per_token > 0 and prof.kv_replay_ms_per_token > 0
    assert prof.patch_form_ms_per_token > 0 and prof.patch_apply_ms_per_token >= 0
    # tiny-qwen2: 4 layers x (K, V) x 2 KV heads x head dim 128/4 = 32 x 4 bytes (fp32)
    assert prof.kv_bytes_per_token == 4 * 2 * 2 * 32 * 4
    # the profile drives the simulator: recompute prefills 24 tokens and runs vision on 16 visual tokens
    res = simulate(T, str(path), strategies=["recompute"], progress=False)
    want = 24 * prof.prefill_ms_per_token + 16 * prof.vision_encode_ms_per_token
    assert res.totals("recompute")["total_ms"] == pytest.approx(want)


def test_cli_calibrate_rejects_bad_options(tmp_path, capsys):
    assert cli.main(["calibrate", "--tokens", "0", "--out", str(tmp_path / "p.json")]) == 1
    assert "tokens must be a positive integer" in capsys.readouterr().err
    assert cli.main(["calibrate", "--out", str(tmp_path)]) == 1  # a directory, caught before any timing
    assert not (tmp_path / "p.json").exists()


def test_served_tokens_come_from_the_result_without_a_trace():
    """The served-token line (context + query of every step) equals a full recompute's prefill, with or without
    the trace passed to the report: simulate records orders and query sizes in the result."""
    from windowkit.trace import simulate
    from windowkit.trace.generators import sliding_window
    from windowkit.trace.report import _orders

    trace = sliding_window(steps=10)
    res = simulate(trace, "h100-kamera", ["recompute"], progress=False)
    for t in (None, trace):
        orders, queries = _orders(t, 10, res)
        served = sum(c.tokens for ctx in orders for c in ctx) + sum(queries)
        assert served == res.totals("recompute")["prefill_tokens"]
