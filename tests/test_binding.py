"""The binding model (issue #5): task generator, checkpoint, eval-binding. No training here.

Frames are decoded back by reading pixels at fixed probe points (not with the generator's code), the
pixel layout is checked against transformers' own Qwen2-VL image processor, and the windowkit path the
evaluation uses is checked against transformers' own forward of the whole sequence.
"""
import json
import math

import numpy as np
import pytest
import torch

from windowkit.models.binding import task

torch.set_num_threads(1)

# probe offsets (x, y) inside a 16-px cell that only one shape fills (besides the centre, which all fill)
_PROBES = {"square": (3, 3), "cross": (1, 8), "triangle": (2, 13)}
_RGB = {(230, 40, 40): "red", (40, 200, 40): "green", (50, 90, 240): "blue", (230, 220, 40): "yellow",
        (210, 40, 210): "magenta", (40, 210, 220): "cyan"}


_GREYS = (20, 70, 120)  # background of the frames tagged 0, 1, 2


def _decode(rgb: np.ndarray, k: int) -> dict:
    """{colour: (cell, shape)} read off the pixels of a frame tagged ``k``."""
    assert tuple(int(v) for v in rgb[0, 0]) == (_GREYS[k],) * 3  # no shape reaches a cell's corner
    out = {}
    for cell in range(task.GRID * task.GRID):
        r, c = divmod(cell, task.GRID)
        x0, y0 = 16 * c, 16 * r
        centre = tuple(int(v) for v in rgb[y0 + 8, x0 + 8])
        if centre == (_GREYS[k],) * 3:
            continue
        filled = [s for s, (dx, dy) in _PROBES.items() if tuple(int(v) for v in rgb[y0 + dy, x0 + dx]) == centre]
        assert len(filled) <= 1, (cell, filled)
        colour = _RGB[centre]
        assert colour not in out  # colours are identities: one object each
        out[colour] = (cell, filled[0] if filled else "circle")
    return out


def test_generator_is_deterministic():
    a, b, c = task.make_item(3, 7), task.make_item(3, 7), task.make_item(3, 8)
    assert all(np.array_equal(x, y) for x, y in zip(a.frames, b.frames))
    assert (a.question, a.answer, a.kind, a.layout) == (b.question, b.answer, b.kind, b.layout)
    assert a.layout != c.layout
    assert a.frames[0].shape == (32, 32, 3) and a.frames[0].dtype == np.uint8


@pytest.mark.parametrize("index", range(12))
def test_answers_match_the_drawn_frames(index):
    for kind in ("single_hop", "multi_hop"):
        item = task.make_item(5, index, kind)
        assert sorted(item.tags) == [0, 1, 2]
        frames = [_decode(f, t) for f, t in zip(item.frames, item.tags)]
        assert frames == item.layout  # every object drawn once, in its cell, with its shape
        assert len(frames[0]) == 4 and set(frames[0]) == set(frames[1]) == set(frames[2])
        shapes = [{col: s for col, (_, s) in f.items()} for f in frames]
        assert shapes[0] == shapes[1]
        changed = [col for col in shapes[0] if shapes[0][col] != shapes[2][col]]
        assert len(changed) == 1
        q = item.question
        assert len(q) == 1
        if kind == "single_hop":
            c, tag = divmod(q[0] - 24, 3)  # question tokens 24.. : colour-major, frame-tag-minor
            frame = item.tags.index(tag)
            colour = ("red", "green", "blue", "yellow", "magenta", "cyan")[c]
            shape_ids = {"circle": 13, "square": 14, "triangle": 15, "cross": 16}
            assert item.answer == shape_ids[shapes[frame][colour]]
        else:
            assert q == [11]
            colour_ids = {"red": 17, "green": 18, "blue": 19, "yellow": 20, "magenta": 21, "cyan": 22}
            assert item.answer == colour_ids[changed[0]]


def test_every_tag_order_occurs():
    """Tags are content, not slots: all six orders appear, so a question names a frame wherever it sits."""
    orders = {tuple(task.make_item(4, i).tags) for i in range(200)}
    assert len(orders) == 6


def test_video_frames_and_questions_match_the_drawn_pixels():
    video = task.make_video(3, 30)
    again = task.make_video(3, 30)
    assert all(np.array_equal(a, b) for a, b in zip(video.frames, again.frames))
    decoded = [_decode(f, t % 3) for t, f in enumerate(video.frames)]
    assert decoded == video.layouts and video.tags == [t % 3 for t in range(30)]
    shapes = [{c: s for c, (_, s) in d.items()} for d in decoded]
    for t in range(1, 30):  # one object changes shape at every even frame from 2 on, none otherwise
        n_changed = sum(shapes[t][c] != shapes[t - 1][c] for c in shapes[t])
        assert n_changed == (1 if t % 2 == 0 else 0), t
    colour_ids = {"red": 17, "green": 18, "blue": 19, "yellow": 20, "magenta": 21, "cyan": 22}
    shape_ids = {"circle": 13, "square": 14, "triangle": 15, "cross": 16}
    slides = [[t - 2, t - 1, t] for t in range(2, 30)]
    for frames in slides + [[t - 11, t - 10, t] for t in range(11, 30)]:
        q = task.window_question(video, frames, seed=1)
        a, b, new = (shapes[t] for t in frames)
        changed = [c for c in new if new[c] != a[c]]
        # multi-hop exactly when the window is a multi-hop item: earlier frames agree, the newest differs in one
        assert (q.kind == "multi_hop") == (a == b and len(changed) == 1), frames
        if q.kind == "multi_hop":
            assert q.ids == [11] and q.answer == colour_ids[changed[0]]
        else:
            c, tag = divmod(q.ids[0] - 24, 3)
            t = [f for f in frames if f % 3 == tag][0]
            colour = ("red", "green", "blue", "yellow", "magenta", "cyan")[c]
            assert q.answer == shape_ids[shapes[t][colour]]
    kinds = [task.window_question(video, f, seed=1).kind for f in slides]
    assert [t for f, k in zip(slides, kinds) if k == "multi_hop" for t in f[2:]] == list(range(2, 30, 2))
    from windowkit.errors import WindowkitError

    with pytest.raises(WindowkitError, match="repeat a tag"):
        task.window_question(video, [0, 3, 4])
    with pytest.raises(WindowkitError, match="inside"):
        task.window_question(video, [28, 29, 30])


def test_frame_three_alone_says_nothing_about_the_answer():
    """Over many items, the changed object's frame-3 shape is as often each shape as the others' are."""
    counts = np.zeros((2, 4))
    for i in range(2000):
        item = task.make_item(11, i, "multi_hop")
        changed = [c for c in item.layout[0] if item.layout[0][c][1] != item.layout[2][c][1]][0]
        for col, (_, shape) in item.layout[2].items():
            counts[int(col == changed), ("circle", "square", "triangle", "cross").index(shape)] += 1
    freq = counts / counts.sum(1, keepdims=True)
    assert np.abs(freq - 0.25).max() < 0.05  # uniform for the changed object and for the others alike


def test_pixels_match_the_qwen2_vl_image_processor():
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor(patch_size=task.PATCH, merge_size=task.MERGE, temporal_patch_size=task.TEMPORAL,
                                 do_resize=False, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    item = task.make_item(0, 1)
    out = proc(images=[item.frames[2]], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [list(task.GRID_THW)]
    torch.testing.assert_close(task.frame_pixels(item.frames[2]), out["pixel_values"].float(), atol=1e-6, rtol=0)


def test_wilson_interval_by_hand():
    from windowkit.models.binding.eval import wilson

    # 8/10: centre (0.8 + 1.96²/20) / (1 + 1.96²/10), half 1.96·sqrt(0.016 + 1.96²/400) / (1 + 1.96²/10)
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 1.0


@pytest.fixture(scope="module")
def model():
    from windowkit.models.binding.model import load

    return load()


def test_checkpoint_is_small_safetensors():
    import os

    from windowkit.models.binding.model import CHECKPOINT_DIR

    path = os.path.join(CHECKPOINT_DIR, "model.safetensors")
    assert os.path.getsize(path) <= 20 * 2 ** 20
    with open(path, "rb") as f:  # safetensors: 8-byte header length, then a JSON header
        n = int.from_bytes(f.read(8), "little")
        assert json.loads(f.read(n))


def test_checkpoint_beats_chance_on_held_out_items(model):
    from windowkit.models.binding.train import HELDOUT_SEED

    n = 64
    for kind in task.KINDS:
        items = [task.make_item(HELDOUT_SEED, 2_000_000 + i, kind) for i in range(n)]
        b = task.batch(items)
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"],
                           mm_token_type_ids=b["mm_token_type_ids"]).logits[:, -1]
        cand = list(task.CANDIDATES[kind])
        pred = torch.tensor(cand)[logits[:, cand].argmax(-1)]
        acc = float((pred == b["labels"]).float().mean())
        chance = 1 / len(cand)
        # well above chance: more than chance + 0.25 (binomial sd at chance and n=64 is ~0.05)
        assert acc > chance + 0.25, (kind, acc)


def test_window_reprefill_matches_transformers_forward(model):
    """The evaluation's exact path (HFBackend + Window over image chunks) gives transformers' own logits."""
    from windowkit.backends.hf import HFBackend
    from windowkit.chunk import Chunk
    from windowkit.models.binding.eval import _blend_logits
    from windowkit.window import Window

    item = task.make_item(9, 3, "multi_hop")
    b = task.batch([item])
    with torch.no_grad():
        ref = model(input_ids=b["input_ids"], pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"],
                    mm_token_type_ids=b["mm_token_type_ids"]).logits[0, -1]
    backend = HFBackend(model)
    prefix = Chunk.text(torch.tensor([task.BOS]), id="bos")
    win = Window(backend, mode="exact", prefix=prefix, rank=None)
    for k in range(3):
        win.admit(task.frame_chunk(item, k))
    torch.testing.assert_close(win.forward(item.question), ref, atol=1e-4, rtol=1e-4)
    # token recompute of 100% of the tokens is the re-prefill
    chunks = [task.frame_chunk(item, k, id=f"b{k}") for k in range(3)]
    torch.testing.assert_close(_blend_logits(backend, prefix, chunks, item.question, 1.0), ref, atol=1e-4, rtol=1e-4)


def test_eval_json_shape(model, tmp_path):
    from windowkit.models.binding import eval as ev

    path = tmp_path / "binding.json"
    assert ev.main(["--n", "2", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert set(res) == {"multi_hop", "single_hop"}
    for kind in res:
        assert set(res[kind]) == {"reprefill", "blind", "rank4", "rank16", "rank64", "blend15"}
        for cell in res[kind].values():
            assert set(cell) == {"accuracy", "n", "ci95"} and cell["n"] == 2
            assert cell["accuracy"] in (0.0, 0.5, 1.0)
            lo, hi = cell["ci95"]
            assert 0 <= lo <= cell["accuracy"] <= hi <= 1 and not math.isnan(lo)
            # Wilson interval at z = 1.96, by hand from the hits
            k, n, z = round(cell["accuracy"] * 2), 2, 1.96
            ph, den = k / n, 1 + z * z / n
            centre, half = (ph + z * z / (2 * n)) / den, z * math.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / den
            assert (lo, hi) == pytest.approx((max(0.0, centre - half), min(1.0, centre + half)), abs=1e-12)
        # the re-prefill column is the model's own answer: transformers' forward over each held-out item
        # (the same items eval draws: seed HELDOUT_SEED, index i, +1e6 for single_hop), argmax over candidates
        hits = 0
        for i in range(2):
            item = task.make_item(ev.HELDOUT_SEED, 1_000_000 * (kind == "single_hop") + i, kind)
            b = task.batch([item])
            with torch.no_grad():
                logits = model(input_ids=b["input_ids"], pixel_values=b["pixel_values"],
                               image_grid_thw=b["image_grid_thw"], mm_token_type_ids=b["mm_token_type_ids"]).logits[0, -1]
            cand = list(task.CANDIDATES[kind])
            hits += int(cand[int(logits[cand].argmax())] == item.answer)
        assert res[kind]["reprefill"]["accuracy"] == hits / 2, (kind, res[kind])
