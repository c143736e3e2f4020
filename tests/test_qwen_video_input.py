"""Qwen-style video input for the long-video agent (agents/video_io.py ``sample_qwen_video``, agents/long_video.py
``QwenVideoEncoder`` / ``LongVideoAgent.load_qwen_video``) on videos OpenCV writes (mp4 and avi).

Ground truth, never windowkit's own output:
* sampling: ``qwen_vl_utils.fetch_video`` / ``process_vision_info`` (0.0.14) reading the same file with decord;
* pixels and grids: transformers' video processors (``Qwen2VLVideoProcessor`` with its own resize,
  ``Qwen3VLVideoProcessor`` with ``do_resize=False`` as the Qwen3-VL README calls it) over the whole video;
* KV: the model's own forward over ``input_ids`` + ``pixel_values_videos`` + ``video_grid_thw`` (+
  ``second_per_grid_ts``) laid out as the processors lay them out, timestamps from ``Qwen3VLProcessor``'s rule.
"""
from __future__ import annotations

import os

import pytest
import torch

from _need import need  # noqa: E402

cv2 = need("cv2", "pip install opencv-python-headless (in requirements.txt: make venv)")
need("qwen_vl_utils", "pip install qwen-vl-utils==0.0.14 (in requirements.txt: make venv)")
need("decord", "pip install decord==0.6.0 (in requirements.txt: make venv; qwen-vl-utils' reference reader)")

from qwen_vl_utils import vision_process as vp  # noqa: E402

from agents.long_video import LongVideoAgent, QwenVideoEncoder, byte_ids, make_plan  # noqa: E402
from agents.video_io import VideoError, qwen_video_element, sample_qwen_video, write_synthetic_video  # noqa: E402
from windowkit.backends.hf import HFBackend  # noqa: E402
from windowkit.backends.tiny import build  # noqa: E402
from windowkit.errors import ChunkError, WindowkitError  # noqa: E402
from windowkit.window import Window  # noqa: E402

try:
    from vl_inputs import mm_token_type_ids
except ImportError:  # pragma: no cover
    from tests.vl_inputs import mm_token_type_ids

QWEN25, QWEN3 = "tiny-qwen2.5-vl", "tiny-qwen3-vl"
KV_ATOL = 1e-5
# pixel budgets in merged tokens per frame, small for the tiny models (factor 28 for Qwen2.5-VL, 32 for Qwen3-VL)
SAMPLINGS = [dict(fps=2.0, min_tokens=4, max_tokens=12), dict(nframes=6, min_tokens=2, max_tokens=6),
             dict(fps=4.0, video_start=1.0, video_end=3.0, resized_height=60, resized_width=100)]


def _kw(sampling: dict, patch: int) -> dict:
    f = 2 * patch
    kw = {k: v for k, v in sampling.items() if not k.endswith("_tokens")}
    if "min_tokens" in sampling:
        kw["min_pixels"], kw["max_pixels"] = sampling["min_tokens"] * f * f, sampling["max_tokens"] * f * f
    return kw


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return {ext: write_synthetic_video(str(d / f"shapes.{ext}"), n_frames=40, fps=10.0, size=(96, 72))
            for ext in ("mp4", "avi")}


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {name: build(name) for name in (QWEN25, QWEN3)}


def _reference(monkeypatch, ele: dict, patch: int):
    """qwen-vl-utils' own fetch_video with decord as its reader: (frames, metadata, sample_fps)."""
    monkeypatch.setattr(vp, "get_video_reader_backend", lambda: "decord")
    (frames, meta), fps = vp.fetch_video(dict(ele), image_patch_size=patch, return_video_sample_fps=True,
                                         return_video_metadata=True)
    return frames, meta, fps


# ---------------------------------------------------------------------- 1. sampling == qwen-vl-utils
@pytest.mark.parametrize("ext", ["mp4", "avi"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["fps", "nframes", "range+resized"])
def test_sampling_equals_qwen_vl_utils(videos, monkeypatch, ext, sampling):
    path = videos[ext]
    for patch in (14, 16):
        kw = _kw(sampling, patch)
        ref, meta, ref_fps = _reference(monkeypatch, {"type": "video", "video": path, **kw}, patch)
        got = sample_qwen_video(path, image_patch_size=patch, **kw)
        assert got.indices == list(meta["frames_indices"]) and got.total_frames == meta["total_num_frames"]
        assert got.frames.dtype == ref.dtype == torch.float32 and got.frames.shape == ref.shape
        assert torch.equal(got.frames, ref)  # OpenCV and decord decode these files bit-identically
        assert got.sample_fps == pytest.approx(ref_fps) and got.video_fps == meta["fps"] == 10.0
        assert got.size[0] % (2 * patch) == 0 and got.size[1] % (2 * patch) == 0


def test_messages_equal_process_vision_info(videos, monkeypatch):
    messages = [{"role": "user", "content": [
        {"type": "video", "video": "file://" + videos["mp4"], "fps": 2.0, "min_pixels": 4 * 784,
         "max_pixels": 12 * 784}, {"type": "text", "text": "What moves?"}]}]
    monkeypatch.setattr(vp, "get_video_reader_backend", lambda: "decord")
    ele = dict(messages[0]["content"][0], video=videos["mp4"])  # decord wants a plain path
    _, ref_videos, ref_kwargs = vp.process_vision_info([{"role": "user", "content": [ele]}],
                                                       return_video_kwargs=True)
    got = sample_qwen_video(messages)
    assert torch.equal(got.frames, ref_videos[0])
    assert [got.sample_fps] == pytest.approx(ref_kwargs["fps"])  # what Qwen2_5_VLProcessor gets as fps
    assert qwen_video_element(messages)["video"] == videos["mp4"]


# ---------------------------------------------------------------------- 2. chunks, grids, KV == processor path
def _processor(name: str, patch: int, kw: dict):
    f = 2 * patch
    size = {"shortest_edge": kw.get("min_pixels", 4 * f * f), "longest_edge": kw.get("max_pixels", 12 * f * f)}
    if name == QWEN3:  # the Qwen3-VL README: processor(..., video_metadata=..., do_resize=False)
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return Qwen3VLVideoProcessor(patch_size=patch, temporal_patch_size=2, merge_size=2, do_resize=False,
                                     do_sample_frames=False)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(patch_size=patch, temporal_patch_size=2, merge_size=2, size=size,
                                 do_sample_frames=False, cap_pixels_per_frame=False)


def _cache_err(kv, cache) -> float:
    return max(max(float((k - layer.keys[0]).abs().max()), float((v - layer.values[0]).abs().max()))
               for (k, v), layer in zip(kv.layers, cache.layers))


@pytest.mark.parametrize("name", [QWEN25, QWEN3])
def test_chunks_and_window_kv_equal_processor_path(videos, models, name):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    model = models[name]
    enc = QwenVideoEncoder(model)
    patch = int(model.config.vision_config.patch_size)
    kw = _kw(SAMPLINGS[0], patch)
    video = sample_qwen_video(videos["mp4"], image_patch_size=patch, **kw)
    chunks = enc(video)
    out = _processor(name, patch, kw)(videos=[video.frames], return_tensors="pt")
    pv, grid = out["pixel_values_videos"], out["video_grid_thw"]
    t, h, w = grid[0].tolist()
    n = h * w // 4
    # one chunk per temporal patch (2 sampled frames), its own grid; pixels == the processor's rows, in order
    assert len(chunks) == t == len(video.indices) // 2 == 4
    assert [c.id for c in chunks] == [f"frame-{k}" for k in range(t)]
    assert all(c.video_grid_thw.tolist() == [[1, h, w]] for c in chunks)
    assert torch.equal(torch.cat([c.pixel_values_videos for c in chunks]), pv)
    assert [c.meta["frame_indices"] for c in chunks] == [tuple(video.indices[2 * k:2 * k + 2]) for k in range(t)]
    cfg = model.config
    vs, pad, ve = cfg.vision_start_token_id, cfg.video_token_id, cfg.vision_end_token_id
    if name == QWEN25:
        # Qwen2_5_VLProcessor: second_per_grid_ts = temporal_patch_size / fps, fps = qwen-vl-utils' sample fps
        assert all(float(c.second_per_grid_ts) == pytest.approx(2 / video.sample_fps) == 1.0 for c in chunks)
        expect_ids = [[vs] + [pad] * n + [ve]] * t
    else:
        stamps = Qwen3VLProcessor._calculate_timestamps(None, list(video.indices), video.video_fps, 2)
        assert [c.meta["time_s"] for c in chunks] == pytest.approx(stamps)
        expect_ids = [byte_ids(f"<{s:.1f} seconds>", 200) + [vs] + [pad] * n + [ve] for s in stamps]
    assert [c.input_ids.tolist() for c in chunks] == expect_ids

    # the Window's KV over the chunks == the model's own forward over the processor-laid inputs
    win = Window(HFBackend(model), mode="patch")
    win.assign(chunks)
    ids = torch.cat([c.input_ids for c in chunks])[None]
    kwargs = dict(input_ids=ids, mm_token_type_ids=mm_token_type_ids(ids), pixel_values_videos=pv)
    if name == QWEN3:  # the chunks back to back ARE Qwen3VLProcessor's layout of the whole video: one grid [T, h, w]
        kwargs["video_grid_thw"] = grid
    else:  # Qwen2.5-VL: T one-patch videos (docs/real-inputs.md: why not one [T, h, w] video)
        kwargs["video_grid_thw"] = torch.tensor([[1, h, w]] * t)
        kwargs["second_per_grid_ts"] = torch.tensor([2 / video.sample_fps] * t)
    model.model.rope_deltas = None
    with torch.no_grad():
        ref = model(**kwargs, use_cache=True)
    cache = getattr(ref, "cache", None) or ref.past_key_values
    kv = win.window_kv()
    assert kv.num_tokens == ids.shape[1] == cache.layers[0].keys.shape[2]
    assert _cache_err(kv, cache) < KV_ATOL
    logits = win.forward([11, 12])
    model.model.rope_deltas = None
    with torch.no_grad():
        ref_q = model(input_ids=torch.tensor([[11, 12]]), past_key_values=cache, use_cache=True,
                      position_ids=torch.full((3, 1, 2), 0) + torch.arange(win.next_position, win.next_position + 2))
    assert (logits - ref_q.logits[0, -1].float()).abs().max() < 1e-4
    if name == QWEN25:
        # the vision tower sees a [T, h, w] video as T separate temporal patches: per-chunk features == whole video's
        with torch.no_grad():
            whole = torch.cat(model.model.get_video_features(pv, grid, return_dict=True).pooler_output)
            parts = [torch.cat(model.model.get_video_features(c.pixel_values_videos, c.video_grid_thw,
                                                              return_dict=True).pooler_output) for c in chunks]
        assert (torch.cat(parts) - whole).abs().max() < 1e-5


# ---------------------------------------------------------------------- 3. the agent on a Qwen-style video
def test_agent_runs_on_messages(videos, models, tmp_path):
    from windowkit.trace import read_trace, simulate

    model = models[QWEN3]
    agent = LongVideoAgent(model, window=2, max_new_tokens=1, record=tmp_path / "qwen_video.jsonl")
    messages = [{"role": "user", "content": [
        {"type": "video", "video": videos["avi"], "nframes": 8, "min_pixels": 2 * 1024, "max_pixels": 6 * 1024},
        {"type": "text", "text": "What moves?"}]}]
    chunks = agent.load_qwen_video(messages)
    assert len(chunks) == 4 and agent.backend.stats.vision_calls == 0  # nothing ran, nothing admitted yet
    report = agent.run(chunks, make_plan(len(chunks), window=2), [20, 21, 22], [30, 31])
    assert [r.frames for r in report.steps] == [[0], [0, 1], [1, 2], [2, 3]]
    assert agent.backend.stats.vision_calls == len(chunks)  # once per temporal-patch chunk
    assert all(r.kl < 1e-6 for r in report.steps[:2])  # admit-only steps: exact
    # the recorded trace holds the video chunks as kind "video" and replays in the simulator
    trace = read_trace(tmp_path / "qwen_video.jsonl")
    assert [st.ids for st in trace] == [[f"frame-{i}" for i in r.frames] + ["question"] for r in report.steps]
    assert all([c.kind for c in st.context] == ["video"] * (len(st.context) - 1) + ["text"] for st in trace)
    assert trace.steps[-1].context[0].tokens == len(chunks[2])
    res = simulate(trace, "cpu-tiny", strategies=["recompute", "windowkit"])
    assert res.totals("recompute")["prefill_tokens"] == sum(r.window_tokens + 2 for r in report.steps)


# ---------------------------------------------------------------------- 4. bad inputs
def _bad_files(d, good: str) -> dict:
    out = {}
    for ext, cc in (("mp4", "mp4v"), ("avi", "MJPG")):
        p = str(d / f"zero.{ext}")
        wr = cv2.VideoWriter(p, cv2.VideoWriter_fourcc(*cc), 10.0, (64, 48))
        wr.release()  # a container with no frames
        out[f"zero-{ext}"] = p
    data = open(good, "rb").read()
    (d / "junk.mp4").write_bytes(bytes(range(256)) * 20)
    (d / "half.avi").write_bytes(data[: len(data) // 2])
    mp4 = write_synthetic_video(str(d / "good.mp4"), n_frames=20, fps=10.0, size=(64, 48))
    data_mp4 = open(mp4, "rb").read()
    (d / "half.mp4").write_bytes(data_mp4[: len(data_mp4) // 2])  # mp4v writes its index (moov) at the end
    out["junk"], out["truncated"], out["truncated-mp4"] = str(d / "junk.mp4"), str(d / "half.avi"), str(d / "half.mp4")
    out["one-frame"] = write_synthetic_video(str(d / "one.avi"), n_frames=1, fps=10.0)
    return out


def test_bad_inputs_raise_and_leave_nothing(videos, models, tmp_path):
    good_avi = write_synthetic_video(str(tmp_path / "good.avi"), n_frames=20, fps=10.0, size=(64, 48))
    bad = _bad_files(tmp_path, good_avi)
    agent = LongVideoAgent(models[QWEN25], window=2, reference=False)
    agent.win.assign(agent.load_qwen_video(good_avi, nframes=4, max_pixels=4 * 784, min_pixels=784))
    ids, stats, vc = agent.win.ids, agent.win.stats.as_dict(), agent.backend.stats.vision_calls
    listing = sorted(os.listdir(tmp_path))
    cases = [(str(tmp_path / "missing.mp4"), {}, "not found"), (str(tmp_path), {}, "not a file"),
             (bad["zero-mp4"], {}, "cannot open"), (bad["zero-avi"], {}, "no decodable frames"),
             (bad["junk"], {}, "cannot open"), (bad["truncated"], {"nframes": 4}, "could not be decoded"),
             (bad["truncated-mp4"], {"nframes": 4}, "cannot open"),
             (bad["one-frame"], {}, "nframes should"), (videos["mp4"], {"fps": 20.0}, "above the video's own 10 fps"),
             (videos["avi"], {"nframes": 44}, "nframes should"), (videos["mp4"], {"fps": 2.0, "nframes": 4}, "either"),
             (videos["mp4"], {"fps": -1.0}, "positive"), (videos["mp4"], {"sample_rate": 2}, "unsupported"),
             (videos["mp4"], {"video_start": 3.0, "video_end": 1.0}, "time range"),
             ("https://example.com/a.mp4", {}, "nothing is downloaded"),
             ([{"role": "user", "content": [{"type": "video", "video": videos["mp4"]}] * 2}], {}, "exactly one"),
             ([{"role": "user"}], {}, "Qwen style"), (42, {}, "expected a video path")]
    for src, kw, msg in cases:
        with pytest.raises(VideoError, match=msg) as ei:
            agent.load_qwen_video(src, **kw)
        assert isinstance(ei.value, ChunkError) and isinstance(ei.value, WindowkitError)
        assert agent.win.ids == ids and agent.win.stats.as_dict() == stats
        assert agent.backend.stats.vision_calls == vc
    assert sorted(os.listdir(tmp_path)) == listing  # nothing written, nothing half-written


# ---------------------------------------------------------------------- 5. the example
def test_example_runs(capsys):
    from examples.qwen_video_input import main

    assert main(["--model", "tiny-qwen3-vl", "--nframes", "8", "--window", "2"]) == 0
    out = capsys.readouterr().out
    assert "sampled 8 frames" in out and "-> 4 chunks" in out and "grid [1, 6, 8]" in out  # 128x96 -> 96x128
    err = float(out.split("the model's own forward over the processor-laid input: max |diff| ")[1].split()[0])
    assert err < KV_ATOL
    vision = out.split("encodes / vision tower calls | ")[1].split(" |")[0]
    assert vision.endswith(" / 4")  # one vision run per chunk
