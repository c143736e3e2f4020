"""Trace schema, JSONL I/O, the VideoTree importer, the generators and the cost profiles."""
from __future__ import annotations

import json
import os
import statistics

import pytest

from windowkit.errors import TraceFormatError, WindowkitError
from windowkit.trace import (ChunkRef, CostProfile, Step, Trace, available_profiles, load_profile, load_videotree,
                             read_trace, write_trace)
from windowkit.trace.generators import append_zoom, grow_interleave, random_lookback, sliding_window
from windowkit.trace.videotree import DEFAULT_PATH, depth_levels

GOOD = {"step": 0, "context": [{"id": "frame-12", "tokens": 64, "kind": "video"},
                               {"id": "q0", "tokens": 20, "kind": "text"}], "ordered": True, "query_tokens": 24}


def test_roundtrip(tmp_path):
    t = sliding_window(steps=12, k=3, seed=4)
    p = write_trace(t, tmp_path / "t.jsonl")
    back = read_trace(p)
    assert back.steps == t.steps and len(p.read_text().splitlines()) == 12


def test_schema_example_from_the_design():
    s = Step.model_validate(GOOD)
    assert s.ids == ["frame-12", "q0"] and s.tokens == 84 and s.context[0].is_visual


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({**GOOD, "context": [{"id": "a", "tokens": 0, "kind": "text"}]}), "tokens"),
    (json.dumps({**GOOD, "context": [{"id": "a", "tokens": 3, "kind": "audio"}]}), "kind"),
    (json.dumps({**GOOD, "extra": 1}), "extra"),
    (json.dumps({**GOOD, "context": [GOOD["context"][0], GOOD["context"][0]]}), "twice"),
])
def test_reader_names_the_bad_line(tmp_path, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")  # the blank line 2 is skipped, the bad one is line 3
    with pytest.raises(TraceFormatError, match=rf"bad.jsonl:3: .*{needle}"):
        read_trace(p)


def test_inconsistent_chunk_across_steps(tmp_path):
    p = tmp_path / "t.jsonl"
    other = {**GOOD, "step": 1, "context": [{"id": "frame-12", "tokens": 32, "kind": "video"}]}
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(other) + "\n")
    with pytest.raises(TraceFormatError, match="frame-12"):
        read_trace(p)
    with pytest.raises(TraceFormatError):
        read_trace(tmp_path / "missing.jsonl")


def test_videotree_importer():
    assert os.path.exists(DEFAULT_PATH), (f"VideoTree trace missing at {DEFAULT_PATH}: set WINDOWKIT_VIDEOTREE "
                                          "to the path of videotree_egoschema_depth_expansion.json")
    raw = json.load(open(DEFAULT_PATH))
    t = load_videotree(tokens_per_frame=64)
    eps = t.meta["episodes"]
    assert len(eps) == len(raw) == 500
    assert statistics.mean(e["frames"] for e in eps) == pytest.approx(62.5, abs=0.05)  # 62.486 per the notes
    assert statistics.mean(e["distinct_frames"] for e in eps) == pytest.approx(56.7, abs=0.1)
    assert len(t) == sum(e["steps"] for e in eps) and all(1 <= e["steps"] <= 3 for e in eps)
    # each episode's last step holds all its distinct frames, sorted, then the question
    first = t.steps[eps[0]["steps"] - 1]
    frames = [c for c in first.context if c.kind == "video"]
    assert len(frames) == eps[0]["distinct_frames"] and first.context[-1].id.endswith("/q")
    assert [c.id for c in frames] == sorted(c.id for c in frames)
    assert all(c.tokens == 64 for c in frames)
    # consecutive questions are different videos: no shared frame ids
    ids0 = {c.id for c in t.steps[0].context}
    ids1 = {c.id for c in t.steps[eps[0]["steps"]].context}
    assert not ids0 & ids1
    assert "MIT" in t.meta["license"]


def test_depth_levels_split():
    frames = list(range(0, 100, 2)) + [10, 20]  # 50 distinct + 2 repeats
    lv = depth_levels(frames, relevance=[1] * 10 + [2] * 5 + [3] * 5)
    assert [len(x) for x in lv] == [20, 20, 10]  # 30 beyond depth 1, split 10:5 clusters at >=2 vs ==3
    assert sorted(sum(lv, [])) == sorted(set(frames))


def test_generators_shapes():
    t = sliding_window(steps=40, k=3, seed=0)
    assert len(t) == 40 and all(1 <= sum(c.kind == "image" for c in s.context) <= 3 for s in t)
    assert all(s.context[0].id.endswith("/task") for s in t)
    t = grow_interleave(episodes=20, seed=0)
    per_ep: dict = {}
    for s in t:
        per_ep.setdefault(s.context[-1].id, []).append([c.id for c in s.context[:-1]])
    for seq in per_ep.values():
        assert len(seq[0]) == 5 and len(seq) <= 3
        for a, b in zip(seq, seq[1:]):
            assert set(a) < set(b) and b == sorted(b)  # grows, in time order
    t = append_zoom(episodes=5, seed=0)
    for a, b in zip(t.steps, t.steps[1:]):
        if b.context[0].id == a.context[0].id:
            assert b.ids[:len(a.ids)] == a.ids and len(b.ids) == len(a.ids) + 1  # prefix stays
    t = random_lookback(steps=200, p=0.3, seed=0)
    looks = sum(1 for s in t if len(s.context) >= 2 and s.context[-1].kind == "image"
                and s.context[-2].kind == "image")
    assert 30 <= looks <= 80  # about p of the non-first steps
    assert random_lookback(steps=50, seed=5).steps == random_lookback(steps=50, seed=5).steps  # seeded


def test_profiles():
    assert {"h100-kamera", "cpu-tiny"} <= set(available_profiles())
    h = load_profile("h100-kamera")
    assert "Kamera: Unified Position-Invariant Multimodal KV Cache" in h.source and "linear" in h.source
    assert h.prefill_ms(1024) == pytest.approx(430) and h.vision_ms(1024) == pytest.approx(230)
    assert h.replay_ms(1024) == pytest.approx(5) and h.patch_apply_ms(1024) == pytest.approx(2.6)
    c = load_profile("cpu-tiny")
    assert c.prefill_ms_per_token > 0 and "measure_profile" in c.source
    with pytest.raises(WindowkitError):
        load_profile("no-such-profile")
    with pytest.raises(WindowkitError):
        CostProfile.from_dict({**h.to_dict(), "prefill_ms_per_token": -1})


def test_trace_stats():
    t = Trace([Step(step=0, context=[ChunkRef(id="a", tokens=3)]), Step(step=1, context=[])])
    assert t.stats()["distinct_chunks"] == 1 and t.stats()["mean_tokens_per_step"] == 1.5
