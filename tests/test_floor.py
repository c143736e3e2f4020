"""The floor strategy (windowkit/trace/floor.py): each chunk prefilled once at its first appearance, every query,
the vision tower once per never-seen visual chunk, nothing else. Hand-counted traces, the lower-bound property on
every generator trace and VideoTree, floor == radix on append-only traces, and the planner's target rule."""
from __future__ import annotations

import json
from itertools import accumulate

import pytest

from windowkit.trace import ChunkRef, CostProfile, Step, Trace, load_videotree, simulate
from windowkit.trace.floor import FloorStrategy, meets, target_for
from windowkit.trace.generators import GENERATORS, append_zoom
from windowkit.trace.simulate import DEFAULT_STRATEGIES, STRATEGIES, make_strategies

from hand_trace import P  # noqa: E402  (tests/hand_trace.py: prefill 1 ms/token, vision 2, replay 0.5)

A = ChunkRef(id="A", tokens=10, kind="image")
B = ChunkRef(id="B", tokens=20, kind="text")
C = ChunkRef(id="C", tokens=30, kind="video")
# A B / B C / A C, query 5 each
ABC = Trace([Step(step=0, context=[A, B], query_tokens=5), Step(step=1, context=[B, C], query_tokens=5),
             Step(step=2, context=[A, C], query_tokens=5)], name="abc")


def test_registered_and_in_the_default_set():
    assert "floor" in STRATEGIES and "floor" in DEFAULT_STRATEGIES
    (s,) = make_strategies(["floor"])
    assert isinstance(s, FloorStrategy) and s.name == "floor"


def test_floor_by_hand():
    res = simulate(ABC, P, ["floor", "radix"], progress=False)
    f = res.steps["floor"]
    # s0: A, B new: 10 + 20 + query 5 = 35 tokens; vision A 10 tokens x 2 ms -> 35 + 20 = 55 ms
    # s1: C new: 30 + 5 = 35 tokens; vision C 30 x 2 = 60 -> 95 ms;  s2: nothing new: the query, 5 ms
    assert [c.prefill_tokens for c in f] == [35, 35, 5]
    assert [c.total_ms for c in f] == [55, 95, 5]
    t = res.totals("floor")
    assert t["prefill_tokens"] == 10 + 20 + 30 + 3 * 5
    assert t["vision_encodes"] == 2 and t["reuse_ms"] == 0 and t["encode_ms"] == 0
    assert (t["encodes"], t["patch_forms"], t["patch_applies"], t["relocations"], t["binding_risk"]) == (0, 0, 0, 0, 0)
    assert [c.bytes_held for c in f] == [30 * 100, 60 * 100, 60 * 100]  # every distinct token seen, kv 100 B/token
    # radix: s0 miss A B (30 + 5, vision A 20 -> 55); s1 no context starts with B: miss B C (50 + 5, vision C 60 ->
    # 115); s2 A hits (the s0 path), C misses (30 + 5 -> 35): 205 ms, 125 tokens
    r = res.totals("radix")
    assert (r["total_ms"], r["prefill_tokens"]) == (205, 125)
    s = res.summary()
    assert s["ratios"]["floor/radix"] == pytest.approx(155 / 205)
    assert s["ratios"]["radix/floor"] == pytest.approx(205 / 155)
    # 155 > 0.6 x 205 = 123: the prefix barely breaks, so the target is within 1.15x of the floor (178.25 ms)
    assert s["target"] == "1.15x floor" and s["target_ms"] == pytest.approx(1.15 * 155)
    assert s["meets_target"] == {"floor": True, "radix": False}


def test_floor_is_order_free_and_charges_a_returning_chunk_nothing():
    rev = Trace([Step(step=s.step, context=list(reversed(s.context)), query_tokens=s.query_tokens) for s in ABC])
    a = simulate(ABC, P, ["floor"], progress=False).totals("floor")
    b = simulate(rev, P, ["floor"], progress=False).totals("floor")
    assert a == b
    # A leaves and returns much later, at another slot: still prefilled and vision-encoded once
    back = Trace([Step(step=0, context=[A]), Step(step=1, context=[B]), Step(step=2, context=[C]),
                  Step(step=3, context=[C, B, A], query_tokens=2)])
    f = simulate(back, P, ["floor"], progress=False).steps["floor"]
    assert [c.prefill_tokens for c in f] == [10, 20, 30, 2]
    assert [c.vision_encodes for c in f] == [1, 0, 1, 0]


def test_target_rule():
    assert target_for(50.0, 100.0) == ("0.6x radix", pytest.approx(60.0))
    assert target_for(60.0, 100.0) == ("0.6x radix", pytest.approx(60.0))  # at exactly 0.6x radix: still 0.6x radix
    assert target_for(70.0, 100.0) == ("1.15x floor", pytest.approx(80.5))
    assert target_for(0.0, 0.0) == ("0.6x radix", 0.0)
    assert meets(1.15 * 0.1 * 3, 1.15 * 0.3) and not meets(80.6, 80.5)
    # a prefix that breaks every step: [A] / [B A] / [C B A], 10 text tokens each, no query
    a, b, c = (ChunkRef(id=i, tokens=10) for i in "abc")
    t = Trace([Step(step=0, context=[a]), Step(step=1, context=[b, a]), Step(step=2, context=[c, b, a])])
    res = simulate(t, P, ["radix", "blind", "floor"], progress=False)
    s = res.summary()
    # radix misses everything: 10 + 20 + 30 = 60 ms; floor 30 ms (0.5x radix); blind 30 + replay (10 + 20) x 0.5 = 45
    assert [s["strategies"][n]["total_ms"] for n in ("radix", "blind", "floor")] == [60, 45, 30]
    assert s["target"] == "0.6x radix" and s["target_ms"] == pytest.approx(36)
    assert s["meets_target"] == {"radix": False, "blind": False, "floor": True}
    assert s["ratios"]["blind/floor"] == pytest.approx(1.5) and s["ratios"]["blind/radix"] == pytest.approx(0.75)
    # no target without both the floor and radix
    s = simulate(t, P, ["blind", "floor"], progress=False).summary()
    assert "target" not in s and "meets_target" not in s and "blind/floor" in s["ratios"]
    assert "target" not in simulate(t, P, ["radix", "blind"], progress=False).summary()


def _cum(costs, key):
    """Running sums of a step's work, the idle work booked on it included (``prefetch(next=...)`` between steps:
    an agent that writes a clip of its history ahead prefills it there, so its step alone may go below the floor)."""
    if key == "total_ms":
        return list(accumulate(c.total_ms + c.idle_ms for c in costs))
    return list(accumulate(c.prefill_tokens + c.idle_tokens for c in costs))


def _assert_lower_bound(res):
    """At every step, the floor's running prefill tokens and modeled time are <= every strategy's, between-step
    work included: whatever a strategy reuses, it computed first."""
    f_tok, f_ms = _cum(res.steps["floor"], "prefill_tokens"), _cum(res.steps["floor"], "total_ms")
    for name in res.strategies:
        tok, ms = _cum(res.steps[name], "prefill_tokens"), _cum(res.steps[name], "total_ms")
        assert all(a <= b for a, b in zip(f_tok, tok)), (res.trace_name, name)
        assert all(a <= b * (1 + 1e-9) for a, b in zip(f_ms, ms)), (res.trace_name, name)


SMALL = {"sliding-3": {"steps": 40}, "sliding-3-clipped": {"steps": 40}, "grow-interleave": {"episodes": 12}, "append-zoom": {"episodes": 12},
         "random-lookback": {"steps": 40}, "grow-interleave-set": {"episodes": 12},
         "grow-interleave-set-small": {"episodes": 12}, "random-lookback-set": {"steps": 40}}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_floor_is_a_lower_bound_on_every_generator(name):
    assert set(SMALL) == set(GENERATORS)  # a new generator must be added here
    trace = GENERATORS[name](**SMALL[name])
    res = simulate(trace, "h100-kamera", list(STRATEGIES), progress=False)
    _assert_lower_bound(res)
    placed = simulate(trace, "cpu-tiny", ["radix", "blind", "blend", "windowkit", "floor"], progress=False,
                      placement="arrival")
    _assert_lower_bound(placed)
    assert placed.totals("floor")["prefill_tokens"] == res.totals("floor")["prefill_tokens"]  # order-free


def test_floor_is_a_lower_bound_on_videotree():
    full = load_videotree()  # all 1353 steps: the analytic strategies and the real Window (~6 s)
    res = simulate(full, "h100-kamera", ["recompute", "radix", "blind", "blend", "windowkit", "floor"],
                   progress=False)
    _assert_lower_bound(res)
    # every frame and question is new to its question's episode: the floor prefills each distinct chunk once
    distinct = full.distinct_chunks().values()
    assert res.totals("floor")["prefill_tokens"] == sum(c.tokens for c in distinct) + sum(s.query_tokens for s in full)
    for ordered in (True, False):  # the real Window on the first questions, ordered and as sets
        part = load_videotree(max_questions=12, ordered=ordered)
        _assert_lower_bound(simulate(part, "cpu-tiny", ["windowkit", "windowkit-lazy", "radix", "floor"],
                                     progress=False, placement=None if ordered else "arrival"))


def test_floor_equals_radix_on_append_only_traces():
    # by hand: [A] / [A B] / [A B C]: each step only appends, so radix's prefix covers everything seen
    t = Trace([Step(step=0, context=[A], query_tokens=3), Step(step=1, context=[A, B], query_tokens=3),
               Step(step=2, context=[A, B, C], query_tokens=3)])
    res = simulate(t, P, ["radix", "floor"], progress=False)
    assert [c.as_dict() for c in res.steps["floor"]] == [c.as_dict() for c in res.steps["radix"]]
    assert res.totals("floor")["prefill_tokens"] == 10 + 20 + 30 + 9
    # LOVE-R1 append-zoom: per episode the fast pass, then one zoom clip appended per step
    for prof in ("h100-kamera", "cpu-tiny"):
        res = simulate(append_zoom(episodes=20), prof, ["radix", "floor"], progress=False)
        for key in ("total_ms", "prefill_tokens", "vision_encodes", "bytes_held"):
            assert [getattr(c, key) for c in res.steps["floor"]] == [getattr(c, key) for c in res.steps["radix"]], key
        s = res.summary()
        assert s["ratios"]["floor/radix"] == pytest.approx(1.0)
        assert s["target"] == "1.15x floor" and s["meets_target"]["radix"] and s["meets_target"]["floor"]


def test_table_report_and_cli_show_the_floor(tmp_path, capsys):
    from windowkit import cli
    from windowkit.trace.report import write_report

    res = simulate(ABC, P, ["radix", "blind", "floor"], progress=False)
    table = res.table()
    assert "| /floor | /radix | meets target |" in table.splitlines()[0]
    assert "| floor | 155.0 |" in table and "target in force: 1.15x floor (178.2 ms; floor/radix 0.756)" in table
    page = write_report(res, tmp_path / "rep", trace=ABC)["html"].read_text()
    assert "<th>vs floor</th>" in page and "<th>meets 1.15x floor</th>" in page
    assert '<p id="target">Target in force: <b>1.15x floor</b>' in page
    assert '<tr><th>floor</th><td>155.0</td>' in page
    out = tmp_path / "s.json"
    assert cli.main(["simulate", "append-zoom", "--strategy", "radix", "--strategy", "floor", "--profile", "cpu-tiny",
                     "--max-steps", "12", "--json", str(out), "--no-progress"]) == 0
    assert "floor/radix: 1.000" in capsys.readouterr().out
    s = json.loads(out.read_text())
    assert s["target"] == "1.15x floor" and s["meets_target"] == {"radix": True, "floor": True}


def test_floor_profile_costs_match_radix_and_recompute():
    """The same CostProfile costs as RadixCache / FullRecompute: on one step with everything new the three agree
    (recompute re-runs vision every step, so only on a single step)."""
    prof = CostProfile(name="odd", source="test", vision_encode_ms_per_token=0.37, prefill_ms_per_token=0.11,
                       kv_replay_ms_per_token=9.0, patch_apply_ms_per_token=9.0, patch_form_ms_per_token=9.0,
                       kv_bytes_per_token=3, patch_bytes_per_token=1)
    t = Trace([Step(step=0, context=[A, B, C], query_tokens=7)])
    res = simulate(t, prof, ["recompute", "radix", "floor"], progress=False)
    want = res.totals("recompute")
    for n in ("radix", "floor"):
        got = res.totals(n)
        assert got["total_ms"] == pytest.approx(want["total_ms"]) and got["prefill_tokens"] == want["prefill_tokens"]
    assert want["total_ms"] == pytest.approx(67 * 0.11 + 40 * 0.37)


def test_bench_floor_rows_and_table():
    """bench/bench_floor.py on one short trace: its row holds the summary's numbers and its table the target."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_floor", Path(__file__).parent.parent / "bench/bench_floor.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    specs = bench.trace_specs(4)
    assert specs[-2:] == ["videotree:4", "videotree-set:4"] and set(GENERATORS) <= set(specs)
    recorded = [s for s in specs if s.endswith(".jsonl")]
    assert len(recorded) >= 4 and all(s.startswith("bench/traces/recorded/") for s in recorded)
    (row,) = bench.run(["append-zoom"], profiles=("cpu-tiny",))
    # (windowkit's own numbers follow the Window's defaults: only their consistency is checked here)
    assert row["target"] == "1.15x floor" and row["ratios"]["floor/radix"] == 1.0
    assert row["strategies"]["floor"] == row["strategies"]["radix"] and row["meets_target"]["floor"]
    wk, fl = row["strategies"]["windowkit"], row["strategies"]["floor"]
    assert row["windowkit_prefill_above_floor"] == wk["prefill_tokens"] - fl["prefill_tokens"] >= 0
    assert row["windowkit_over_target"] == pytest.approx(wk["total_ms"] / row["target_ms"] - 1)
    ahead = row["strategies"]["windowkit-ahead"]  # append-only: nothing to prepare between steps
    assert ahead["idle_tokens"] == 0 and ahead["prefill_tokens"] == fl["prefill_tokens"]
    md = bench.markdown([row])
    assert "| ahead meets |" in md.splitlines()[0]
    assert md.splitlines()[2].startswith("| append-zoom | cpu-tiny | 154 |") and "| 1.15x floor |" in md


@pytest.mark.parametrize("profile", ["h100-kamera", "cpu-tiny"])
def test_windowkit_defaults_never_cost_a_step_more_than_the_prefix_cache(profile):
    """Every trace of bench_floor (generators, the recorded agent traces, VideoTree's first 30 questions ordered and
    as sets): no step of the default Window costs more than the radix cache's same step. A look-back to a context
    the radix tree still holds is read from the Window's store as is (``reused_as_is``) and charged nothing, as
    the tree's hit is; before, those reads cost the recorded VLM traces 1.0001-1.0024x radix."""
    import importlib.util
    from pathlib import Path

    from windowkit.trace.cli import load_trace_arg

    root = Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location("bench_floor", root / "bench/bench_floor.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    as_is = 0
    for name in bench.trace_specs(30):
        trace = load_trace_arg(str(root / name) if name.endswith(".jsonl") else name)
        res = simulate(trace, profile, strategies=["radix", "windowkit"], progress=False)
        above = [i for i, (r, w) in enumerate(zip(res.steps["radix"], res.steps["windowkit"]))
                 if w.total_ms > r.total_ms * (1 + 1e-9)]
        assert not above, (name, above[:5])
        if name.endswith("long_video_qwen.jsonl"):  # steps 12 and 16: a look-back read as is, no reuse charge
            w, r = res.steps["windowkit"], res.steps["radix"]
            as_is += sum(w[i].total_ms == pytest.approx(r[i].total_ms) and w[i].reuse_ms == 0 for i in (12, 16))
    assert as_is == 2
