"""Import the VideoTree EgoSchema result file as a windowkit trace.

The file (``Ziyang412/VideoTree`` ``results/depth_expansion_res.json``, MIT licence; a copy and its licence
ship in ``windowkit/trace/data/``) holds 500 EgoSchema questions, each ``{"name": uuid, "sorted_values": [frame
indices 0-179, sorted, with repeats], "relevance": [1|2|3 per first-level cluster]}``.

Conversion (the file has no per-frame tree depth, so levels are reconstructed by count):
  * each question is one agent episode on its own video; frame ids are ``"<uuid>/f<index>"`` so frames of
    different questions never collide; a repeated index is the same frame (held once: about 9% repeats);
  * depth 1 holds ``len(relevance)`` frames (one keyframe per first-level cluster), depth 2 and 3 split
    the remaining distinct frames in proportion to the clusters with relevance >= 2 and == 3 (VideoTree
    expands relevance-2 clusters one level and relevance-3 clusters two levels);
  * which frames belong to which depth: depth 1 takes evenly spaced frames of the sorted distinct set,
    depth 2 evenly spaced frames of the rest, depth 3 the remainder;
  * step j of an episode holds every frame of depth <= j, sorted by time (new frames interleave with old
    ones: the grow-and-interleave pattern), then the question text chunk ``"<uuid>/q"`` at the tail;
  * frames are ``video`` chunks of ``tokens_per_frame`` tokens; steps are ordered (time order) unless
    ``ordered=False``: VideoTree *selects a set* of keyframes (each carries its timestamp), so any order of
    a step's frames is acceptable and a placement policy may choose it (the question stays in the set).

    trace = load_videotree()   # the bundled copy (DEFAULT_PATH), or a path to another result file
    len(trace.meta["episodes"])   # 500
"""
from __future__ import annotations

import json
import os
from typing import Optional, Union

from windowkit.errors import TraceFormatError
from windowkit.trace.schema import ChunkRef, Step, Trace

_NAME = "videotree_egoschema_depth_expansion.json"


def _default_path() -> str:
    """$WINDOWKIT_VIDEOTREE, else the copy shipped with windowkit (``windowkit/trace/data/``)."""
    return os.environ.get("WINDOWKIT_VIDEOTREE") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", _NAME)


DEFAULT_PATH = _default_path()


def _spread(items: list[int], k: int) -> list[int]:
    """k evenly spaced items of a sorted list (first and last included when k >= 2)."""
    n = len(items)
    if k >= n:
        return list(items)
    if k <= 0:
        return []
    if k == 1:
        return [items[n // 2]]
    return [items[round(i * (n - 1) / (k - 1))] for i in range(k)]


def depth_levels(frames: list[int], relevance: list[int]) -> list[list[int]]:
    """Split a question's distinct sorted frames into depth-1/2/3 levels (see the module docstring)."""
    distinct = sorted(set(int(f) for f in frames))
    n1 = min(len(relevance), len(distinct))
    lvl1 = _spread(distinct, n1)
    rest = [f for f in distinct if f not in set(lvl1)]
    c2 = sum(1 for r in relevance if r >= 2)
    c3 = sum(1 for r in relevance if r >= 3)
    n2 = len(rest) if c2 + c3 == 0 else round(len(rest) * c2 / (c2 + c3))
    lvl2 = _spread(rest, n2)
    lvl3 = [f for f in rest if f not in set(lvl2)]
    return [lvl for lvl in (lvl1, lvl2, lvl3) if lvl]


def load_videotree(path: Union[str, os.PathLike] = DEFAULT_PATH, *, tokens_per_frame: int = 64,
                   question_tokens: int = 48, query_tokens: int = 16, max_questions: Optional[int] = None,
                   ordered: bool = True) -> Trace:
    """The VideoTree file as a Trace (about 3 steps per question). ``meta["episodes"]`` lists, per question,
    its uuid, the number of frame entries in the file (with repeats), distinct frames and steps.

        trace = load_videotree(tokens_per_frame=64, max_questions=50)
        trace = load_videotree(max_questions=100, ordered=False)   # name "videotree-egoschema-set"
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise TraceFormatError(f"{path}: cannot read VideoTree results: {e}") from None
    if not isinstance(data, list):
        raise TraceFormatError(f"{path}: expected a JSON list of questions")
    steps: list[Step] = []
    episodes = []
    for qi, q in enumerate(data[:max_questions] if max_questions is not None else data):
        try:
            name, frames, rel = str(q["name"]), list(q["sorted_values"]), list(q["relevance"])
        except (KeyError, TypeError):
            raise TraceFormatError(f"{path}: question {qi} lacks name / sorted_values / relevance") from None
        if any(not 0 <= int(f) < 100000 for f in frames):
            raise TraceFormatError(f"{path}: question {qi} has a negative or absurd frame index")
        levels = depth_levels(frames, rel)
        question = ChunkRef(id=f"{name}/q", tokens=question_tokens, kind="text")
        shown: list[int] = []
        for lvl in levels:
            shown = sorted(shown + lvl)
            ctx = [ChunkRef(id=f"{name}/f{f:03d}", tokens=tokens_per_frame, kind="video") for f in shown]
            steps.append(Step(step=len(steps), context=ctx + [question], ordered=ordered, query_tokens=query_tokens))
        episodes.append({"name": name, "frames": len(frames), "distinct_frames": len(set(frames)),
                         "steps": len(levels)})
    return Trace(steps, name="videotree-egoschema" + ("" if ordered else "-set"), meta={"ordered": ordered,
        "source": str(path), "license": "MIT (Ziyang412/VideoTree), see LICENSE.videotree",
        "tokens_per_frame": tokens_per_frame, "question_tokens": question_tokens, "episodes": episodes})


__all__ = ["load_videotree", "depth_levels", "DEFAULT_PATH"]
