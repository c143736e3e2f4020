"""Seeded generators of agent access patterns (docs/simulation.md, "Generated patterns", lists them).

  sliding_window    WebVoyager / OSWorld: task prompt + the last k screenshots (k=3); each screenshot is
                    read on k consecutive steps, then never again.
  sliding_clipped   WebVoyager's context rule: the last k screenshots, every older observation clipped to its
                    text in the place its screenshot held (the prefix breaks where the newest clip lands).
  grow_interleave   VideoAgent: 5 uniform frames, then up to 2 retrieval rounds; all frames re-sent sorted
                    by time, so new frames land *between* old ones and prefixes break (mean ~8.4 frames).
  append_zoom       LOVE-R1: a fast low-res pass over the video, then zoom clips appended after the
                    question: the prefix stays stable.
  random_lookback   PAL-UI / DVD: captions of every past step (text) + the current screenshot, and with
                    probability p a Retrieve(j) of a random earlier screenshot appended at the tail.

Every generator takes ``seed`` and returns a Trace whose ``meta`` records its parameters.

Unordered variants (``ordered: false`` steps, same listed order; a placement policy may choose another):
``grow_interleave(ordered=False)`` ("grow-interleave-set"), ``grow_interleave_set_small`` (at most 7 chunks a
step, for the exact offline placement search) and ``random_lookback(ordered=False)`` ("random-lookback-set").

    trace = sliding_window(steps=100, k=3, seed=0)
"""
from __future__ import annotations

import random
from typing import Optional

from windowkit.trace.schema import ChunkRef, Step, Trace


def _img(cid: str, tokens: int) -> ChunkRef:
    return ChunkRef(id=cid, tokens=tokens, kind="image")


def _txt(cid: str, tokens: int) -> ChunkRef:
    return ChunkRef(id=cid, tokens=tokens, kind="text")


def _episodes(steps: int, episode_len: tuple[int, int], rng: random.Random, context, **step_kw) -> tuple[list[Step], int]:
    """``steps`` steps in episodes of ``episode_len`` (uniform, inclusive) steps each: step t of episode ep holds
    ``context(ep, t)`` (which may draw from ``rng`` too, after the episode's length). Returns the steps and the
    number of episodes begun."""
    out: list[Step] = []
    ep = 0
    while len(out) < steps:
        n = rng.randint(*episode_len)
        for t in range(min(n, steps - len(out))):
            out.append(Step(step=len(out), context=context(ep, t), **step_kw))
        ep += 1
    return out, ep


def sliding_window(steps: int = 100, k: int = 3, *, shot_tokens: int = 765, task_tokens: int = 64,
                   episode_len: tuple[int, int] = (3, 12), query_tokens: int = 32, seed: int = 0) -> Trace:
    """Episodes of ``episode_len`` (uniform, inclusive) steps; step t holds [task, shot_{t-k+1..t}].

        t = sliding_window(steps=20, k=3)   # WebVoyager: 765-token screenshots, 3-12 steps per task
    """
    def context(ep: int, t: int) -> list[ChunkRef]:
        return [_txt(f"e{ep}/task", task_tokens)] + [_img(f"e{ep}/shot{j}", shot_tokens)
                                                     for j in range(max(0, t - k + 1), t + 1)]

    out, ep = _episodes(steps, episode_len, random.Random(seed), context, query_tokens=query_tokens)
    return Trace(out, name=f"sliding-{k}", meta={"generator": "sliding_window", "k": k, "shot_tokens": shot_tokens,
                                                "task_tokens": task_tokens, "episodes": ep, "seed": seed})


def sliding_clipped(steps: int = 100, k: int = 3, *, shot_tokens: int = 765, text_tokens: int = 96,
                    task_tokens: int = 64, episode_len: tuple[int, int] = (3, 12), max_text: Optional[int] = None,
                    query_tokens: int = 32, seed: int = 0) -> Trace:
    """WebVoyager's own context rule: step t holds [task, text_0..text_{t-k}, shot_{t-k+1..t}]: the last ``k``
    observations as screenshots, every older one clipped to its text (its thought / action / page text, a new
    chunk of ``text_tokens``) in the place its screenshot held. Each step the observation that leaves the last k
    turns into text where it stood, so a prefix cache keeps only the task and the older texts and re-prefills the
    new text and all k screenshots; the survivors' own KV is conditioned on a screenshot that is now text.
    ``max_text``: keep at most that many texts (the oldest drop off the front; None: all of the episode).

        t = sliding_clipped(steps=20)   # name "sliding-3-clipped"
    """
    def context(ep: int, t: int) -> list[ChunkRef]:
        first_shot = max(0, t - k + 1)
        lo = 0 if max_text is None else max(0, first_shot - max_text)
        return ([_txt(f"c{ep}/task", task_tokens)] + [_txt(f"c{ep}/text{j}", text_tokens) for j in range(lo, first_shot)]
                + [_img(f"c{ep}/shot{j}", shot_tokens) for j in range(first_shot, t + 1)])

    out, ep = _episodes(steps, episode_len, random.Random(seed), context, query_tokens=query_tokens)
    return Trace(out, name=f"sliding-{k}-clipped",
                 meta={"generator": "sliding_clipped", "k": k, "shot_tokens": shot_tokens, "text_tokens": text_tokens,
                       "task_tokens": task_tokens, "max_text": max_text, "episodes": ep, "seed": seed})


def grow_interleave(episodes: int = 50, *, video_frames: int = 180, start_frames: int = 5, rounds: int = 2,
                    add_per_round: tuple[int, int] = (0, 3), frame_tokens: int = 256, question_tokens: int = 48,
                    query_tokens: int = 16, seed: int = 0, ordered: bool = True) -> Trace:
    """VideoAgent: per question, 5 uniform frames, then ``rounds`` retrieval rounds adding
    ``add_per_round`` frames each (uniform; 0 ends the search early); every step re-sends all selected
    frames sorted by time, then the question.

    ``ordered=False`` marks every step as a set (listed in the same time-sorted order): VideoAgent
    selects *which* frames to look at; each frame carries its timestamp, so any order is acceptable.

        t = grow_interleave(episodes=10)
        t = grow_interleave(episodes=10, ordered=False)   # name "grow-interleave-set"
    """
    rng = random.Random(seed)
    out: list[Step] = []
    for ep in range(episodes):
        q = _txt(f"v{ep}/q", question_tokens)
        sel = sorted({round((i + 0.5) * video_frames / start_frames) for i in range(start_frames)})
        for r in range(rounds + 1):
            if r > 0:
                n_add = rng.randint(*add_per_round)
                if n_add == 0:
                    break
                free = [f for f in range(video_frames) if f not in sel]
                sel = sorted(sel + rng.sample(free, min(n_add, len(free))))
            ctx = [ChunkRef(id=f"v{ep}/f{f:03d}", tokens=frame_tokens, kind="video") for f in sel]
            out.append(Step(step=len(out), context=ctx + [q], query_tokens=query_tokens, ordered=ordered))
    return Trace(out, name="grow-interleave" + ("" if ordered else "-set"),
                 meta={"generator": "grow_interleave", "episodes": episodes, "start_frames": start_frames,
                       "rounds": rounds, "add_per_round": list(add_per_round), "frame_tokens": frame_tokens,
                       "seed": seed, "ordered": ordered})


def append_zoom(episodes: int = 50, *, fast_chunks: int = 8, fast_tokens: int = 1024, zooms: tuple[int, int] = (1, 3),
                zoom_tokens: int = 2048, question_tokens: int = 48, query_tokens: int = 16, seed: int = 0) -> Trace:
    """LOVE-R1: step 0 is [fast video segments..., question]; each later step appends one zoom clip.

        t = append_zoom(episodes=10)    # fast pass: 8 x 1024 tokens; zoom clips 2048 tokens
    """
    rng = random.Random(seed)
    out: list[Step] = []
    for ep in range(episodes):
        ctx = [ChunkRef(id=f"z{ep}/fast{i}", tokens=fast_tokens, kind="video") for i in range(fast_chunks)]
        ctx.append(_txt(f"z{ep}/q", question_tokens))
        out.append(Step(step=len(out), context=list(ctx), query_tokens=query_tokens))
        for j in range(rng.randint(*zooms)):
            ctx.append(ChunkRef(id=f"z{ep}/zoom{j}", tokens=zoom_tokens, kind="video"))
            out.append(Step(step=len(out), context=list(ctx), query_tokens=query_tokens))
    return Trace(out, name="append-zoom", meta={"generator": "append_zoom", "episodes": episodes,
                                                "fast_chunks": fast_chunks, "zoom_tokens": zoom_tokens, "seed": seed})


def random_lookback(steps: int = 100, *, p: float = 0.3, shot_tokens: int = 765, caption_tokens: int = 48,
                    task_tokens: int = 64, episode_len: tuple[int, int] = (8, 20), query_tokens: int = 32,
                    seed: int = 0, max_captions: Optional[int] = None, ordered: bool = True) -> Trace:
    """PAL-UI: step t holds [task, caption_0..caption_{t-1}, shot_t] and, with probability ``p``,
    a random earlier raw screenshot shot_j (j < t) appended at the tail. Episodes of 8-20 steps
    (GUI-Odyssey averages 15.3). ``max_captions`` keeps only the last captions (None: all).

    ``ordered=False`` marks every step as a set (same listed order): each caption and screenshot is
    labelled with its step number, so the agent's prompt stays readable in any order.

        t = random_lookback(steps=100, p=0.3)
        t = random_lookback(steps=100, ordered=False)   # name "random-lookback-set"
    """
    rng = random.Random(seed)

    def context(ep: int, t: int) -> list[ChunkRef]:
        lo = 0 if max_captions is None else max(0, t - max_captions)
        ctx = ([_txt(f"u{ep}/task", task_tokens)] + [_txt(f"u{ep}/cap{j}", caption_tokens) for j in range(lo, t)]
               + [_img(f"u{ep}/shot{t}", shot_tokens)])
        if t > 0 and rng.random() < p:
            ctx.append(_img(f"u{ep}/shot{rng.randrange(t)}", shot_tokens))
        return ctx

    out, ep = _episodes(steps, episode_len, rng, context, query_tokens=query_tokens, ordered=ordered)
    return Trace(out, name="random-lookback" + ("" if ordered else "-set"),
                 meta={"generator": "random_lookback", "p": p, "episodes": ep, "shot_tokens": shot_tokens,
                       "seed": seed, "ordered": ordered})


def grow_interleave_set(episodes: int = 50, **kw) -> Trace:
    """``grow_interleave(ordered=False)``: the frame selection as a set (see grow_interleave)."""
    return grow_interleave(episodes, ordered=False, **kw)


def grow_interleave_set_small(episodes: int = 50, **kw) -> Trace:
    """Unordered grow-interleave with at most 7 chunks a step (2 start frames, 2 rounds of 0-2 frames,
    the question): small enough for ``policies.placement.OfflineOptimal``'s exact search.

        t = grow_interleave_set_small(episodes=20)   # name "grow-interleave-set-small"
    """
    kw = {"start_frames": 2, "add_per_round": (0, 2), **kw}
    t = grow_interleave(episodes, ordered=False, **kw)
    return Trace(t.steps, name="grow-interleave-set-small", meta=t.meta)


def random_lookback_set(steps: int = 100, **kw) -> Trace:
    """``random_lookback(ordered=False)``: the screenshot history as a set (see random_lookback)."""
    return random_lookback(steps, ordered=False, **kw)


GENERATORS = {"sliding-3": sliding_window, "sliding-3-clipped": sliding_clipped, "grow-interleave": grow_interleave,
              "append-zoom": append_zoom,
              "random-lookback": random_lookback,
              # unordered variants (``ordered: false`` steps; a placement policy chooses the order)
              "grow-interleave-set": grow_interleave_set, "grow-interleave-set-small": grow_interleave_set_small,
              "random-lookback-set": random_lookback_set}

__all__ = ["sliding_window", "sliding_clipped", "grow_interleave", "append_zoom", "random_lookback", "grow_interleave_set",
           "grow_interleave_set_small", "random_lookback_set", "GENERATORS"]
