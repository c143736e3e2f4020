"""The synthetic multi-frame binding task: three OpenCV frames of coloured shapes, then a question.

    item = make_item(seed=7, index=0)        # deterministic in (seed, index)
    item.frames                              # 3 x RGB uint8 [32, 32, 3]
    item.question, item.answer, item.kind    # token ids, answer token id, "single_hop" | "multi_hop"

Every frame shows the same four objects on a 2x2 grid of 16-px cells, one per cell, cells reshuffled from
frame to frame, on a background grey that tells the frame. An object's identity is its colour (four
distinct colours out of six per item); its shape (circle, square, triangle, cross; repeats allowed) is
the property that changes: frames 1 and 2 agree, in frame 3 exactly one object has a new shape.

  single_hop  "what shape is the <colour> object in frame <k>?"    -> a shape   (read from one frame)
  multi_hop   "which object changed shape between frames 1 and 3?" -> a colour  (needs frames 1 and 3)

Why this design (and not "where did the red shape move to"): frame 3 alone is uninformative (its shapes
are i.i.d. uniform whichever object changed), so the answer exists only in the *binding* of each frame-3
object to its frame-1 twin. A causal model computes it per object, in frame 3's own tokens (each attends
to the frame-1 token of its colour and compares shapes); one query token cannot compare four pairs
itself. So the binding is written into frame 3's KV, which blind reuse drops. Cells are not answers:
under RoPE a token's value carries no position. The identity is the colour (a salient pixel feature the
attention can key on at once); with shape as the identity the model stayed at the prior (see docs).

Sequence layout (all items the same length, 23 tokens):
  [BOS] + 3 x [FRAME_k, VISION_START, IMAGE x 4, VISION_END] + 1 question token; loss on the answer only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GRID = 2  # cells per side: 4 cells, all filled (a 4x4 grid with 12 empty cells stayed at the prior: see docs)
CELL = 16  # pixels per cell
FRAME = GRID * CELL  # 32 x 32 frames
PATCH = 16  # vision patch size: one patch per cell
MERGE = 1  # no spatial merge: one visual token per cell (a 2x2 merge of 8-px patches costs 2x the CPU time)
TEMPORAL = 2
N_FRAMES = 3
VISUAL_TOKENS = (FRAME // PATCH // MERGE) ** 2  # 4 per frame

SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = ("red", "green", "blue", "yellow", "magenta", "cyan")
# RGB of each colour (frames are RGB; OpenCV draws whatever channel order it is given)
RGB = {"red": (230, 40, 40), "green": (40, 200, 40), "blue": (50, 90, 240), "yellow": (230, 220, 40),
       "magenta": (210, 40, 210), "cyan": (40, 210, 220)}
# background grey of frames 1..3: a frame's tokens carry its index in their content (a learned M-RoPE
# offset alone made "frame k" slow to pick up: no progress in 300 CPU steps)
BACKGROUNDS = (20, 70, 120)

# vocabulary (ids < VOCAB)
PAD, BOS, EOS, VISION_START, VISION_END, IMAGE, VIDEO = range(7)
FRAME_TOKENS = (7, 8, 9)  # FRAME_1..3
Q_CHANGED = 11  # "which object changed shape between frame 1 and frame 3?"
SHAPE_TOKENS = tuple(range(13, 13 + len(SHAPES)))
COLOUR_TOKENS = tuple(range(17, 17 + len(COLOURS)))
# one token per single-hop question "what shape is the <colour> object in frame <k>?": Q_SHAPE_OF[c][k]
# (a one-token question lets the query attend by content at once; a 4-token question needed an extra
# gather step and the model stayed at the answer prior for 300 CPU steps)
Q_SHAPE_OF = tuple(tuple(24 + 3 * c + k for k in range(3)) for c in range(len(COLOURS)))
VOCAB = 48
KINDS = ("single_hop", "multi_hop")
CANDIDATES = {"single_hop": SHAPE_TOKENS, "multi_hop": COLOUR_TOKENS}  # answer set of each kind
SEQ_LEN = 1 + N_FRAMES * (VISUAL_TOKENS + 3) + 1


@dataclass
class Item:
    """One question over three frames; ``layout`` records what was drawn (for tests and debugging)."""

    frames: list  # N_FRAMES x RGB uint8 [FRAME, FRAME, 3]
    question: list  # token ids (one token)
    answer: int  # token id
    kind: str  # "single_hop" | "multi_hop"
    layout: list  # per frame: {colour: (cell, shape)}


def draw_frame(layout: dict, k: int = 0) -> np.ndarray:
    """RGB uint8 [32, 32, 3] of frame ``k`` (0-based; sets the background grey) with each
    ``colour: (cell, shape)`` drawn filled inside its 16-px cell."""
    import cv2

    img = np.full((FRAME, FRAME, 3), BACKGROUNDS[k], dtype=np.uint8)
    for colour, (cell, shape) in layout.items():
        r, c = divmod(cell, GRID)
        x0, y0 = c * CELL, r * CELL
        col = RGB[colour]
        if shape == "circle":
            cv2.circle(img, (x0 + 8, y0 + 8), 6, col, thickness=-1)
        elif shape == "square":
            cv2.rectangle(img, (x0 + 3, y0 + 3), (x0 + 12, y0 + 12), col, thickness=-1)
        elif shape == "triangle":
            pts = np.array([[x0 + 8, y0 + 1], [x0 + 1, y0 + 14], [x0 + 14, y0 + 14]], dtype=np.int32)
            cv2.fillPoly(img, [pts], col)
        else:  # cross
            cv2.rectangle(img, (x0 + 6, y0 + 1), (x0 + 9, y0 + 14), col, thickness=-1)
            cv2.rectangle(img, (x0 + 1, y0 + 6), (x0 + 14, y0 + 9), col, thickness=-1)
    return img


def changed_colour(item: "Item") -> str:
    """The colour (identity) of the object whose shape differs between frames 1 and 3."""
    return [c for c in item.layout[0] if item.layout[0][c][1] != item.layout[2][c][1]][0]


def make_item(seed: int, index: int, kind: str | None = None) -> Item:
    """Item ``index`` of the stream seeded by ``seed`` (independent of every other item)."""
    rng = np.random.default_rng([int(seed), int(index)])
    if kind is None:
        kind = KINDS[int(rng.integers(2))]
    n = len(SHAPES)
    colours = [COLOURS[i] for i in rng.permutation(len(COLOURS))[:n]]  # the four objects
    shapes1 = [SHAPES[int(i)] for i in rng.integers(len(SHAPES), size=n)]  # repeats allowed
    changed = int(rng.integers(n))
    shapes3 = list(shapes1)
    others = [s for s in SHAPES if s != shapes1[changed]]
    shapes3[changed] = others[int(rng.integers(len(others)))]
    layouts = []
    for shapes in (shapes1, shapes1, shapes3):
        cells = rng.permutation(GRID * GRID)[:n]
        layouts.append({c: (int(cells[i]), shapes[i]) for i, c in enumerate(colours)})
    if kind == "single_hop":
        c = int(rng.integers(n))
        k = int(rng.integers(N_FRAMES))
        question = [Q_SHAPE_OF[COLOURS.index(colours[c])][k]]
        answer = SHAPE_TOKENS[SHAPES.index(layouts[k][colours[c]][1])]
    elif kind == "multi_hop":
        question = [Q_CHANGED]
        answer = COLOUR_TOKENS[COLOURS.index(colours[changed])]
    else:
        from windowkit.errors import WindowkitError

        raise WindowkitError(f"kind must be one of {KINDS}, got {kind!r}")
    return Item([draw_frame(l, k) for k, l in enumerate(layouts)], question, answer, kind, layouts)


def make_training_sequence(seed: int, index: int, n_questions: int = 8) -> tuple[Item, list, list]:
    """A training sequence: the frames of ``make_item(seed, index)`` followed by ``n_questions`` question /
    answer pairs (at most one multi_hop, no single_hop repeated). Returns (item, question tokens with the
    answers in between, the answers). The first question is exactly ``item.question``, so the first answer
    is trained in the evaluation's format; the others amortise the vision tower over more supervision.
    """
    item = make_item(seed, index)
    rng = np.random.default_rng([int(seed), int(index), 1])
    present = list(item.layout[0])
    pairs = [(c, k) for c in present for k in range(N_FRAMES)]
    qs, answers = [list(item.question)], [item.answer]
    extra = [pairs[int(i)] for i in rng.permutation(len(pairs))]
    multi_slot = -1 if item.kind == "multi_hop" else int(rng.integers(1, n_questions + 2))  # may fall off the end
    for j in range(1, n_questions):
        if j == multi_slot:
            qs.append([Q_CHANGED])
            answers.append(COLOUR_TOKENS[COLOURS.index(changed_colour(item))])
            continue
        c, k = extra.pop()
        if [Q_SHAPE_OF[COLOURS.index(c)][k]] == item.question:
            c, k = extra.pop()
        qs.append([Q_SHAPE_OF[COLOURS.index(c)][k]])
        answers.append(SHAPE_TOKENS[SHAPES.index(item.layout[k][c][1])])
    tokens: list = []
    for q, a in zip(qs, answers):
        tokens += q + [a]
    return item, tokens[:-1], answers


def training_batch(seed: int, indices, n_questions: int = 8) -> dict:
    """``batch`` of training sequences: input_ids [B, L] (frames + Q1 A1 .. Qn), answer positions [n] (the
    index of the token after which each answer is predicted) and labels [B, n]."""
    import torch

    seqs = [make_training_sequence(seed, i, n_questions) for i in indices]
    b = batch([it for it, _, _ in seqs])
    qa = torch.tensor([t for _, t, _ in seqs])
    base = SEQ_LEN - 1  # index of the first question token
    ids = torch.cat([b["input_ids"][:, :base], qa], 1)
    b["input_ids"] = ids
    b["mm_token_type_ids"] = (ids == IMAGE).long()
    b["answer_positions"] = torch.tensor([base + 2 * j for j in range(n_questions)])
    b["labels"] = torch.tensor([a for _, _, a in seqs])
    return b


def frame_pixels(rgb: np.ndarray) -> "torch.Tensor":
    """Qwen2-VL processor layout of one frame: [grid_h * grid_w, 3 * TEMPORAL * PATCH * PATCH] float32,
    merge groups contiguous, the frame repeated over the temporal patch (as the processor does for images),
    scaled to [-1, 1]."""
    import torch

    x = torch.from_numpy(rgb).float().permute(2, 0, 1) / 127.5 - 1.0  # [3, H, W]
    g = FRAME // PATCH
    p = x.reshape(3, g // MERGE, MERGE, PATCH, g // MERGE, MERGE, PATCH)
    p = p.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    p = p.unsqueeze(5).expand(-1, -1, -1, -1, -1, TEMPORAL, -1, -1)
    return p.reshape(g * g, 3 * TEMPORAL * PATCH * PATCH).contiguous()


GRID_THW = (1, FRAME // PATCH, FRAME // PATCH)


def frame_ids(k: int) -> list:
    """Token ids of frame chunk ``k`` (0-based): [FRAME_k, VISION_START, IMAGE x 4, VISION_END]."""
    return [FRAME_TOKENS[k], VISION_START] + [IMAGE] * VISUAL_TOKENS + [VISION_END]


def frame_chunk(item: Item, k: int, id: str = ""):
    """Frame ``k`` of ``item`` as a windowkit image Chunk."""
    import torch

    from windowkit.chunk import Chunk

    return Chunk.image(torch.tensor(frame_ids(k)), pixel_values=frame_pixels(item.frames[k]),
                       image_grid_thw=torch.tensor([GRID_THW]), id=id or f"frame{k + 1}")


def batch(items: list) -> dict:
    """Model inputs for a list of items: input_ids [B, SEQ_LEN], mm_token_type_ids, pixel_values, image_grid_thw,
    labels [B] (the answer token of each item)."""
    import torch

    ids, pix = [], []
    for it in items:
        seq = [BOS]
        for k in range(N_FRAMES):
            seq += frame_ids(k)
            pix.append(frame_pixels(it.frames[k]))
        ids.append(seq + list(it.question))
    input_ids = torch.tensor(ids)
    # mm_token_type_ids: without it transformers' forward gives the image pads text positions (1-D), not M-RoPE
    return dict(input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE).long(), pixel_values=torch.cat(pix, 0),
                image_grid_thw=torch.tensor([GRID_THW] * (len(items) * N_FRAMES)),
                labels=torch.tensor([it.answer for it in items]))


__all__ = ["Item", "make_item", "changed_colour", "draw_frame", "frame_pixels", "frame_chunk", "frame_ids", "batch", "SHAPES",
           "COLOURS", "KINDS", "CANDIDATES", "VOCAB", "SEQ_LEN"]
