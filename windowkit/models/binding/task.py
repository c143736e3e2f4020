"""The synthetic multi-frame binding task: OpenCV frames of coloured shapes, then a question.

    item = make_item(seed=7, index=0)        # deterministic in (seed, index)
    item.frames, item.tags                   # 3 x RGB uint8 [32, 32, 3]; each frame's tag (0..2)
    item.question, item.answer, item.kind    # token ids, answer token id, "single_hop" | "multi_hop"
    video = make_video(seed=0, n_frames=60)  # the same objects over time: the long-video example's input

Every frame shows the same four objects on a 2x2 grid of 16-px cells, one per cell, cells reshuffled from
frame to frame, on a background grey that gives the frame's *tag* (0, 1 or 2; a video frame's tag is its
time step mod 3; the three frames of an item carry the three tags in any order). The frame chunk opens
with its tag token too. An object's identity is its colour (four distinct colours out of six); its shape
(circle, square, triangle, cross; repeats allowed) is the property that changes: frames 1 and 2 agree,
in frame 3 exactly one object has a new shape.

  single_hop  "what shape is the <colour> object in the frame tagged <k>?" -> a shape  (read from one frame)
  multi_hop   "which object changed shape in the newest frame?"            -> a colour (needs frames 1 and 3)

Why tags, not slots: a frame is named by its content, so the same frame is the same chunk wherever the
window puts it; a sliding window reuses it (relocation) instead of re-encoding it.

Why this design (and not "where did the red shape move to"): frame 3 alone is uninformative (its shapes
are i.i.d. uniform whichever object changed), so the answer exists only in the *binding* of each frame-3
object to its frame-1 twin. A causal model computes it per object, in frame 3's own tokens (each attends
to the earlier tokens of its colour and compares shapes); one query token cannot compare four pairs
itself. So the binding is written into frame 3's KV, which blind reuse drops. Cells are not answers:
under RoPE a token's value carries no position. The identity is the colour (a salient pixel feature the
attention can key on at once); with shape as the identity the model stayed at the prior (see docs).

Sequence layout (all items the same length, 23 tokens):
  [BOS] + 3 x [FRAME_TAG, VISION_START, IMAGE x 4, VISION_END] + 1 question token; loss on the answer only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from windowkit.chunk import Chunk
from windowkit.errors import WindowkitError

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
# background grey of each frame *tag* (a video frame's tag is its time step mod 3): a frame's tokens carry
# the tag in their content, so a question can name a frame by content, not by its slot in the window (a
# learned M-RoPE offset alone made "frame k" slow to pick up: no progress in 300 CPU steps). Content, not
# slot, is what makes a frame chunk reusable when the window slides: the same frame at another slot is
# the same chunk.
BACKGROUNDS = (20, 70, 120)
N_TAGS = len(BACKGROUNDS)

# vocabulary (ids < VOCAB)
PAD, BOS, EOS, VISION_START, VISION_END, IMAGE, VIDEO = range(7)
FRAME_TOKENS = (7, 8, 9)  # the frame-tag token opening a frame chunk: FRAME_TAG_0..2
Q_CHANGED = 11  # "which object changed shape in the newest frame?" (the earlier frames agree)
SHAPE_TOKENS = tuple(range(13, 13 + len(SHAPES)))
COLOUR_TOKENS = tuple(range(17, 17 + len(COLOURS)))
# one token per single-hop question "what shape is the <colour> object in the frame tagged <k>?": Q_SHAPE_OF[c][k]
# (a one-token question lets the query attend by content at once; a 4-token question needed an extra
# gather step and the model stayed at the answer prior for 300 CPU steps)
Q_SHAPE_OF = tuple(tuple(24 + 3 * c + k for k in range(3)) for c in range(len(COLOURS)))
# training-only auxiliary question "did the <colour> object change shape in the newest frame?" -> YES / NO:
# dense supervision for the per-object comparison the multi-hop answer needs (``make_training_sequence(aux=)``)
Q_DID_CHANGE = tuple(range(42, 42 + len(COLOURS)))
NO, YES = 10, 12
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
    tags: list = None  # per frame: its tag (background grey, FRAME_TAG token); a permutation of 0..2


def draw_frame(layout: dict, k: int = 0) -> np.ndarray:
    """RGB uint8 [32, 32, 3] of a frame tagged ``k`` (the tag sets the background grey) with each
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
    tags = [int(t) for t in rng.permutation(N_TAGS)]  # any order: a sliding video shows every rotation
    if kind == "single_hop":
        c = int(rng.integers(n))
        k = int(rng.integers(N_FRAMES))
        question = [Q_SHAPE_OF[COLOURS.index(colours[c])][tags[k]]]
        answer = SHAPE_TOKENS[SHAPES.index(layouts[k][colours[c]][1])]
    elif kind == "multi_hop":
        question = [Q_CHANGED]
        answer = COLOUR_TOKENS[COLOURS.index(colours[changed])]
    else:
        raise WindowkitError(f"kind must be one of {KINDS}, got {kind!r}")
    return Item([draw_frame(l, t) for l, t in zip(layouts, tags)], question, answer, kind, layouts, tags)


def make_training_sequence(seed: int, index: int, n_questions: int = 8, aux: int = 0) -> tuple[Item, list, list]:
    """A training sequence: the frames of ``make_item(seed, index)`` followed by ``n_questions`` question /
    answer pairs (at most one multi_hop, no single_hop repeated). Returns (item, question tokens with the
    answers in between, the answers). The first question is exactly ``item.question``, so the first answer
    is trained in the evaluation's format; the others amortise the vision tower over more supervision.

    ``aux`` > 0: a sequence that starts single_hop asks ``aux`` "did the <colour> object change shape?"
    questions (distinct colours, in random slots) and no multi_hop one, so no earlier answer gives away a
    later one (a "which changed" answer would give away every "did it change"; the reverse too).
    """
    item = make_item(seed, index)
    rng = np.random.default_rng([int(seed), int(index), 1])
    present = list(item.layout[0])
    pairs = [(c, k) for c in present for k in range(N_FRAMES)]
    qs, answers = [list(item.question)], [item.answer]
    extra = [pairs[int(i)] for i in rng.permutation(len(pairs))]
    multi_slot = -1 if item.kind == "multi_hop" else int(rng.integers(1, n_questions + 2))  # may fall off the end
    aux_slots: dict = {}
    if aux and item.kind == "single_hop":
        multi_slot = -1
        slots = 1 + rng.permutation(n_questions - 1)[:aux]
        aux_slots = {int(j): present[int(i)] for j, i in zip(slots, rng.permutation(len(present)))}
    changed = changed_colour(item)
    for j in range(1, n_questions):
        if j in aux_slots:
            c = aux_slots[j]
            qs.append([Q_DID_CHANGE[COLOURS.index(c)]])
            answers.append(YES if c == changed else NO)
            continue
        if j == multi_slot:
            qs.append([Q_CHANGED])
            answers.append(COLOUR_TOKENS[COLOURS.index(changed)])
            continue
        c, k = extra.pop()
        # no repeat of the first question; before the multi_hop slot, nothing about the changed object (its
        # shape in two frames would give the multi_hop answer away)
        while [Q_SHAPE_OF[COLOURS.index(c)][item.tags[k]]] == item.question or (j < multi_slot and c == changed):
            c, k = extra.pop()
        qs.append([Q_SHAPE_OF[COLOURS.index(c)][item.tags[k]]])
        answers.append(SHAPE_TOKENS[SHAPES.index(item.layout[k][c][1])])
    tokens: list = []
    for q, a in zip(qs, answers):
        tokens += q + [a]
    return item, tokens[:-1], answers


def training_batch(seed: int, indices, n_questions: int = 8, aux: int = 0) -> dict:
    """``batch`` of training sequences: input_ids [B, L] (frames + Q1 A1 .. Qn), answer positions [n] (the
    index of the token after which each answer is predicted) and labels [B, n]."""
    seqs = [make_training_sequence(seed, i, n_questions, aux) for i in indices]
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
    x = torch.from_numpy(rgb).float().permute(2, 0, 1) / 127.5 - 1.0  # [3, H, W]
    g = FRAME // PATCH
    p = x.reshape(3, g // MERGE, MERGE, PATCH, g // MERGE, MERGE, PATCH)
    p = p.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    p = p.unsqueeze(5).expand(-1, -1, -1, -1, -1, TEMPORAL, -1, -1)
    return p.reshape(g * g, 3 * TEMPORAL * PATCH * PATCH).contiguous()


GRID_THW = (1, FRAME // PATCH, FRAME // PATCH)


def frame_ids(tag: int) -> list:
    """Token ids of a frame chunk tagged ``tag``: [FRAME_TAG, VISION_START, IMAGE x 4, VISION_END]."""
    return [FRAME_TOKENS[tag], VISION_START] + [IMAGE] * VISUAL_TOKENS + [VISION_END]


def frame_chunk(item: Item, k: int, id: str = ""):
    """Frame ``k`` of ``item`` as a windowkit image Chunk."""
    return Chunk.image(torch.tensor(frame_ids(item.tags[k])), pixel_values=frame_pixels(item.frames[k]),
                       image_grid_thw=torch.tensor([GRID_THW]), id=id or f"frame{k + 1}")


# ====================================================================== a video of the same objects
@dataclass
class Video:
    """A synthetic video for the binding model: the same four objects in every frame, cells reshuffled
    every frame, one object's shape changing at every even frame from 2 on; frame t is tagged t mod 3."""

    frames: list  # n x RGB uint8 [FRAME, FRAME, 3]
    layouts: list  # per frame: {colour: (cell, shape)}
    tags: list  # per frame: t mod N_TAGS (three consecutive frames carry three different tags)
    seed: int = 0  # which video: part of every chunk id, so two videos never share an id

    def __len__(self) -> int:
        return len(self.frames)

    def shapes(self, t: int) -> dict:
        return {c: shape for c, (_, shape) in self.layouts[t].items()}


def make_video(seed: int, n_frames: int) -> Video:
    """Video ``seed`` of ``n_frames`` frames (deterministic; independent of the item streams).

        v = make_video(0, 24)
        v.frames[5], v.tags[5]          # RGB [32, 32, 3], 5 % 3 == 2
    """
    if n_frames < 1:
        raise WindowkitError(f"a video needs at least one frame, got n_frames={n_frames}")
    rng = np.random.default_rng([int(seed), 7_000_003])
    n = len(SHAPES)
    colours = [COLOURS[i] for i in rng.permutation(len(COLOURS))[:n]]
    shapes = [SHAPES[int(i)] for i in rng.integers(len(SHAPES), size=n)]
    layouts, tags = [], []
    for t in range(n_frames):
        if t >= 2 and t % 2 == 0:  # one object takes a new shape: windows [t-2, t-1, t] are multi-hop items
            o = int(rng.integers(n))
            others = [x for x in SHAPES if x != shapes[o]]
            shapes[o] = others[int(rng.integers(len(others)))]
        cells = rng.permutation(GRID * GRID)[:n]
        layouts.append({c: (int(cells[i]), shapes[i]) for i, c in enumerate(colours)})
        tags.append(t % N_TAGS)
    return Video([draw_frame(l, k) for l, k in zip(layouts, tags)], layouts, tags, int(seed))


def video_chunk(video: Video, t: int):
    """Frame ``t`` of ``video`` as a windowkit image Chunk (id ``v<seed>-frame-<t>``: the same chunk at any
    slot, and never the id of another video's frame)."""
    return Chunk.image(torch.tensor(frame_ids(video.tags[t])), pixel_values=frame_pixels(video.frames[t]),
                       image_grid_thw=torch.tensor([GRID_THW]), id=f"v{video.seed}-frame-{t}", frame_index=t)


@dataclass
class Question:
    """A question about the frames of one window: one token, its answer token, its kind."""

    ids: list
    answer: int
    kind: str  # "single_hop" | "multi_hop"
    text: str  # what it asks, in words

    @property
    def candidates(self) -> tuple:
        return CANDIDATES[self.kind]


def window_question(video: Video, frames, seed: int = 0) -> Question:
    """The question for a window holding ``frames`` (video frame indices, in window order).

    multi_hop when the window is a multi-hop item (its earlier frames agree, its newest frame differs in
    exactly one object's shape: "which object changed shape in the newest frame?"), else single_hop about
    an object in one of its frames, named by that frame's tag (drawn from ``seed`` and the frames).
    """
    frames = [int(t) for t in frames]
    if not frames or any(not 0 <= t < len(video) for t in frames):
        raise WindowkitError(f"window frames {frames} must be non-empty and inside 0..{len(video) - 1}")
    if len({video.tags[t] for t in frames}) != len(frames):
        raise WindowkitError(f"frames {frames} repeat a tag (t mod {N_TAGS}): a question could not name one frame")
    if len(frames) >= 2:
        first = video.shapes(frames[0])
        newest = video.shapes(frames[-1])
        diff = [c for c in first if first[c] != newest[c]]
        if all(video.shapes(t) == first for t in frames[:-1]) and len(diff) == 1:
            return Question([Q_CHANGED], COLOUR_TOKENS[COLOURS.index(diff[0])], "multi_hop",
                            "which object changed shape in the newest frame?")
    rng = np.random.default_rng([int(seed), *frames])
    t = frames[int(rng.integers(len(frames)))]
    colour = list(video.layouts[t])[int(rng.integers(len(video.layouts[t])))]
    return Question([Q_SHAPE_OF[COLOURS.index(colour)][video.tags[t]]],
                    SHAPE_TOKENS[SHAPES.index(video.layouts[t][colour][1])], "single_hop",
                    f"what shape is the {colour} object in frame {t}?")


def batch(items: list) -> dict:
    """Model inputs for a list of items: input_ids [B, SEQ_LEN], mm_token_type_ids, pixel_values, image_grid_thw,
    labels [B] (the answer token of each item)."""
    ids, pix = [], []
    for it in items:
        seq = [BOS]
        for k in range(N_FRAMES):
            seq += frame_ids(it.tags[k])
            pix.append(frame_pixels(it.frames[k]))
        ids.append(seq + list(it.question))
    input_ids = torch.tensor(ids)
    # mm_token_type_ids: without it transformers' forward gives the image pads text positions (1-D), not M-RoPE
    return dict(input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE).long(), pixel_values=torch.cat(pix, 0),
                image_grid_thw=torch.tensor([GRID_THW] * (len(items) * N_FRAMES)),
                labels=torch.tensor([it.answer for it in items]))


__all__ = ["Item", "make_item", "changed_colour", "draw_frame", "frame_pixels", "frame_chunk", "frame_ids", "batch",
           "Video", "make_video", "video_chunk", "Question", "window_question", "SHAPES", "COLOURS", "KINDS",
           "CANDIDATES", "VOCAB", "SEQ_LEN"]
