"""Trace recording (windowkit.trace.TraceRecorder), the examples (simulate_trace.py, long_video_qa.py --record),
the quickstart's Python blocks (the API reference's coverage of every public name: tests/test_api_surface.py).

Light: tiny-qwen2 for the recorder and the quickstart, tiny-qwen2.5-vl on a 12-frame 56x56 synthetic video
for the examples (no exact reference window)."""
from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest
import torch

import windowkit as wk
from _need import need
from windowkit.errors import TraceFormatError, WindowkitError
from windowkit.trace import TraceRecorder, read_trace, simulate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def backend():
    from windowkit.backends.tiny import build

    torch.set_num_threads(1)
    return wk.HFBackend(build("tiny-qwen2"))


def _text(n: int, seed: int, id: str = "") -> wk.Chunk:
    g = torch.Generator().manual_seed(seed)
    return wk.Chunk.text(torch.randint(10, 120, (n,), generator=g), id=id)


# ====================================================================== TraceRecorder
def test_recorder_writes_the_window_in_order(backend, tmp_path):
    win = wk.Window(backend, rank=8)
    a, b, q = _text(24, 0), _text(16, 1), _text(5, 2, id="question")
    path = tmp_path / "sub" / "rec.jsonl"  # the folder is created
    with TraceRecorder(path) as rec:
        win.admit(a)
        rec.record(win, query_tokens=3)
        win.admit(b)
        win.admit(q)
        rec.record(win, query_tokens=3)
        win.evict("head")
        rec.record(win, query_tokens=3)
        win.recall(a.id, at=0)  # back in front
        rec.record(win, query_tokens=0, ordered=False)
        assert len(read_trace(path)) == 4  # flushed line by line: readable before close
    assert rec.closed
    t = read_trace(path)
    ids = [st.ids for st in t]
    assert ids == [[a.id], [a.id, b.id, "question"], [b.id, "question"], [a.id, b.id, "question"]]
    assert a.id == a.content_hash()[:16]  # a chunk without an explicit id is named by its content
    assert [st.tokens for st in t] == [24, 45, 21, 45]
    assert [st.query_tokens for st in t] == [3, 3, 3, 0] and [st.ordered for st in t] == [True, True, True, False]
    assert all(c.kind == "text" for st in t for c in st.context)
    assert [st.step for st in t] == [0, 1, 2, 3]
    # the file is the io.py format: one compact JSON object per line
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[1])["context"][2] == {"id": "question", "tokens": 5, "kind": "text"}


def test_recorder_on_a_file_object_and_a_chunk_list(backend):
    buf = io.StringIO()
    img = wk.Chunk.image(torch.tensor([3, 4, 4, 5]), pixel_values=torch.zeros(8, 12),
                         image_grid_thw=torch.tensor([[1, 4, 2]]), id="shot-0")
    rec = TraceRecorder(buf)
    step = rec.record([img, _text(6, 3, id="task")], query_tokens=2)
    rec.close()
    assert not buf.closed  # the caller's file stays open
    assert step.ids == ["shot-0", "task"] and [(c.tokens, c.kind) for c in step.context] == [(4, "image"), (6, "text")]
    assert json.loads(buf.getvalue()) == {"step": 0, "ordered": True, "query_tokens": 2,
                                          "context": [{"id": "shot-0", "tokens": 4, "kind": "image"},
                                                      {"id": "task", "tokens": 6, "kind": "text"}]}


def test_recorder_refuses_what_would_not_read_back(tmp_path):
    path = tmp_path / "bad.jsonl"
    rec = TraceRecorder(path)
    rec.record([_text(6, 0, id="x")])
    with pytest.raises(TraceFormatError, match="'x'"):
        rec.record([_text(7, 1, id="x")])  # same id, other token count
    with pytest.raises(TraceFormatError):
        rec.record([_text(6, 0, id="x")], query_tokens=-1)
    with pytest.raises(TraceFormatError):
        rec.record(["not a chunk"])
    rec.close()
    rec.close()  # idempotent
    with pytest.raises(WindowkitError, match="closed"):
        rec.record([_text(6, 0, id="x")])
    assert len(read_trace(path)) == 1  # only the good step was written
    with pytest.raises(TraceFormatError):
        TraceRecorder(42)
    with pytest.raises(TraceFormatError, match="cannot write"):
        TraceRecorder(tmp_path)  # a folder


# ====================================================================== examples
def test_simulate_trace_records_the_agent_and_replays_it(tmp_path, capsys):
    need("cv2", "pip install opencv-python-headless (in requirements.txt: make venv)")
    from examples.simulate_trace import main

    rec = tmp_path / "agent.jsonl"
    out = tmp_path / "report"
    assert main(["--frames", "12", "--steps", "12", "--window", "3", "--size", "56x56", "--lookback", "10",
                 "--profile", "cpu-tiny", "--record", str(rec), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    t = read_trace(rec)
    # windows: steps 0-2 hold 1, 2, 3 frames; steps 3-9 and 11 hold 3; the look-back at 10 holds 0-2 and 10
    held = [len(st.context) - 1 for st in t]
    assert held == [1, 2, 3] + [3] * 7 + [4, 3]
    # frame ids are video frame indices: sampled at 4 fps from the 8 fps synthetic video, every second frame
    assert t.steps[10].ids == ["frame-0", "frame-2", "frame-4", "frame-20", "question"]
    # full recompute = every window (6 tokens a 56x56 frame, a 12-token question) + the 2-token prompt, per step
    expect = sum(6 * n + 12 + 2 for n in held)
    assert expect == 372
    row = next(line for line in text.splitlines() if line.startswith("| recompute |"))
    assert row.split("|")[4].strip() == str(expect)
    assert "windowkit/radix:" in text and "| windowkit |" in text
    assert (out / "summary.json").is_file()


def test_simulate_trace_replays_a_generated_trace(capsys):
    from examples.simulate_trace import main

    assert main(["--trace", "sliding-3", "--profile", "cpu-tiny", "--max-steps", "30",
                 "--strategy", "recompute", "--strategy", "windowkit"]) == 0
    text = capsys.readouterr().out
    assert "replayed 30 steps under profile cpu-tiny" in text and "windowkit/recompute:" in text
    assert main(["--trace", "/nonexistent/trace.jsonl"]) == 2  # a TraceFormatError, reported


def test_long_video_example_records_its_steps(tmp_path, capsys):
    need("cv2", "pip install opencv-python-headless (in requirements.txt: make venv)")
    from examples.long_video_qa import main

    rec = tmp_path / "lv.jsonl"
    assert main(["--model", "tiny-qwen2.5-vl", "--frames", "4", "--steps", "4", "--window", "2", "--size", "56x56",
                 "--lookback", "", "--record", str(rec)]) == 0
    text = capsys.readouterr().out
    t = read_trace(rec)
    assert [st.ids[:-1] for st in t] == [["frame-0"], ["frame-0", "frame-2"], ["frame-2", "frame-4"],
                                         ["frame-4", "frame-6"]]  # video frame indices, sampled at 4 of 8 fps
    assert f"trace: 4 steps written to {rec}" in text
    assert "argmax agreement" in text and "next-token KL" in text


def test_long_video_example_defaults_to_the_binding_model(capsys):
    need("cv2", "pip install opencv-python-headless (in requirements.txt: make venv)")
    from examples.long_video_qa import main

    assert main(["--frames", "13", "--no-reference"]) == 0  # 13 steps, one look-back (step 11: frames 0, 1, 11; a multi-hop item too)
    text = capsys.readouterr().out
    assert text.startswith("model binding | video binding video 0") and "look-back at [11]" in text
    assert "| accuracy, multi_hop (7 steps): windowkit / exact re-prefill / blind |" in text
    assert main(["--video", "clip.mp4"]) == 2  # the binding model only watches its own video
    assert "--video needs a Qwen-VL checkpoint" in capsys.readouterr().err
    assert main(["--window", "4"]) == 2  # four frames would repeat a tag: refused before any step runs
    assert "--window must be at most 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--refresh", "threshold:x"])
    assert e.value.code == 2 and "takes a number" in capsys.readouterr().err
    assert main(["--frames", "13", "--guess", "slide", "--no-reference"]) == 0  # a guess policy between steps
    text = capsys.readouterr().out
    # a guess after each slide (steps 3-11), the one before the look-back at step 11 wrong (its two survivors: 14)
    assert "guesses: 9 made, 9 prepared, 8 right; 14 tokens prefilled for wrong ones" in text, text[-600:]
    with pytest.raises(SystemExit) as e:
        main(["--guess", "slide", "--anticipate"])
    assert e.value.code == 2 and "exclude each other" in capsys.readouterr().err


# ====================================================================== docs
def _python_blocks(md: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", md.read_text(encoding="utf-8"), flags=re.S)


def test_quickstart_python_runs(tmp_path, monkeypatch, capsys):
    blocks = _python_blocks(ROOT / "docs" / "quickstart.md")
    assert len(blocks) == 4
    first = [ln for ln in blocks[0].splitlines() if ln.strip()]
    assert len(first) == 10  # "ten lines of Python"
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    ns: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"quickstart.md block {i}", "exec"), ns)
    win = ns["win"]
    assert win.ids == [ns["b"], ns["a"]]  # a evicted from the head, recalled at the tail
    # lazy forming (the default): a's prefill at position 0 is its canonical; b keeps its conditioned prefill,
    # is repaired wholly after the eviction (it is the first stale survivor), and a's recall is its conditioned
    # prefill at the tail: one encode, and 64 + 64 + 64 + 64 prefilled tokens (the query's forward is not a window edit)
    assert win.stats.encodes == 1
    assert win.stats.repaired_tokens == 64 and win.stats.prefill_tokens == 4 * 64
    assert ns["logits"].shape[-1] == 128  # tiny-qwen2's vocabulary
    t = read_trace(tmp_path / "quickstart.jsonl")
    assert t.steps[0].ids == [ns["b"], ns["a"]] and t.steps[0].tokens == 128
    res = simulate(t, "cpu-tiny", strategies=["recompute"])
    assert res.totals("recompute")["prefill_tokens"] == 64 + 64 + 3
    # the second block's number, KL(exact || windowkit), is float rounding here: b, alone at the head after the
    # eviction, takes its canonical KV (exact: no antecedent), and a's recall behind b ran one conditioned
    # forward (stats: forwards) whose KV it keeps; measured 0.0
    from windowkit.kv import kl_divergence

    kl = kl_divergence(ns["ref"].forward(torch.tensor([5, 6, 7])), ns["logits"])
    assert math.isfinite(kl) and 0 <= kl < 1e-9
    # the agent loop: with the next slide prepared between steps, each slide forwards only the new observation
    # (its printed lines), and the last step's logits equal the model's own forward over the window and question
    steps = [ln.split() for ln in capsys.readouterr().out.splitlines() if re.fullmatch(r"\d \w+ \d+", ln)]
    assert steps == [["3", "prefill", "192"], ["4", "edit", "64"], ["5", "edit", "64"], ["6", "edit", "64"]]
    agent, obs = ns["agent"], ns["obs"]
    assert agent.ids == ["obs3", "obs4", "obs5"]
    ids = torch.cat([c.input_ids for c in obs[3:6]] + [torch.tensor([5, 6, 7])])
    with torch.no_grad():
        ref = ns["backend"].model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).logits[0, -1]
    assert kl_divergence(ref.float(), ns["answer"]) <= 1e-6
