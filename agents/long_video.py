"""A long-video QA agent on a windowkit ``Window``: slide over sampled frames, look back when asked.

    from agents.long_video import LongVideoAgent, make_plan
    agent = LongVideoAgent(model, window=6)                       # a Qwen2.5-VL / Qwen3-VL model
    frames = agent.load_video("clip.avi", fps=2.0, max_frames=24) # decoded + processed before any edit
    plan = make_plan(len(frames), window=6, steps=20, lookback_at=[12, 16])
    report = agent.run(frames, plan, question_ids, prompt_ids)
    for row in report.steps: print(row.kind, row.ops, row.delta, row.answer)

    agent = LongVideoAgent(model, window=6, record="run.jsonl")  # also write each step's window as a trace
    chunks = agent.load_qwen_video("clip.mp4", fps=2.0, max_pixels=64 * 28 * 28)  # Qwen-style (docs/real-inputs.md)

Each step holds ``window`` frames plus the question chunk at the tail and reaches that window with one
``win.assign([...frames..., question])``: on a slide the head frame is evicted (survivors only relocate)
and the new frame admitted in front of the question; on a look-back step the frames t-10..t-8 come back
by ``recall`` (canonical from the store + R(δ) + a fresh rank-m patch: no vision tower run, no
re-encode). Every step logs the deltas of ``win.stats`` and of the backend's ``vision_calls``, the
greedy answer tokens, and, when a reference is kept, fidelity against exact re-prefill of the same
window (next-token KL, argmax and answer agreement) and the tokens a prefix cache would re-prefill.
With ``record=PATH`` every step's window (frames + question, in order) and its query size (the answer
prompt) is appended to a JSONL trace (``windowkit.trace.TraceRecorder``) that ``windowkit simulate`` replays.

Frames become image chunks without downloads: transformers' Pillow Qwen2-VL image processor (small
pixel budget) gives ``pixel_values`` and ``image_grid_thw``; the ids are
``[<vision_start>] + [<image_pad>] * n_merged + [<vision_end>]`` with the model config's token ids.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from transformers import AutoTokenizer

from agents.common import common_prefix, common_prefix_tokens
from agents.video_io import Frame, VideoError, read_frames, sample_qwen_video, write_synthetic_video
from policies.guess import make_guess
from policies.refresh import make_refresh
from windowkit.backends.hf import HFBackend
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError, UnsupportedModelError, WindowkitError
from windowkit.kv import concat
from windowkit.kv.metrics import kl_divergence
from windowkit.models.binding import task
from windowkit.trace.record import recording
from windowkit.window import Window

#: ``win.stats`` fields logged per step (deltas), plus the backend's ``vision_calls``
STAT_FIELDS = ("encodes", "patch_forms", "patch_reuses", "patch_applies", "relocations", "prefill_tokens",
               "reused_tokens", "forwards", "fallbacks", "est_ms_saved")


# ====================================================================== frames -> image chunks
class FrameEncoder:
    """Turns RGB frames into Qwen-VL image chunks with the Pillow Qwen2-VL image processor (offline).

    ``size=(w, h)`` is rounded to multiples of patch_size * merge_size (28 for Qwen2.5-VL, 32 for
    Qwen3-VL) and the processor's pixel budget is pinned to it, so every frame gets the same grid.
    ``image_mean`` / ``image_std`` are read from ``preprocessor_config.json`` when ``model_path`` has one.
    """

    def __init__(self, model: Any, size: tuple[int, int] = (112, 84), model_path: Optional[str] = None):
        cfg = model.config
        vc = getattr(cfg, "vision_config", None)
        needed = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
        if vc is None or any(getattr(cfg, n, None) is None for n in needed):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a Qwen-VL model (needs vision_config and {', '.join(needed)})")
        # needs PIL (the vision extra)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.patch = int(vc.patch_size)
        self.merge = int(vc.spatial_merge_size)
        self.temporal = int(getattr(vc, "temporal_patch_size", 2))
        factor = self.patch * self.merge
        w = max(factor, round(int(size[0]) / factor) * factor)
        h = max(factor, round(int(size[1]) / factor) * factor)
        self.size = (w, h)
        kw: dict = {}
        if model_path and os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
            with open(os.path.join(model_path, "preprocessor_config.json")) as f:
                pc = json.load(f)
            kw = {k: pc[k] for k in ("image_mean", "image_std") if k in pc}
        self.processor = Qwen2VLImageProcessorPil(min_pixels=factor * factor, max_pixels=w * h, patch_size=self.patch,
                                                  temporal_patch_size=self.temporal, merge_size=self.merge, **kw)
        self.ids = (int(cfg.vision_start_token_id), int(cfg.image_token_id), int(cfg.vision_end_token_id))
        self.dtype = next(model.parameters()).dtype

    def __call__(self, frame: Frame) -> Chunk:
        from PIL import Image

        img = Image.fromarray(frame.rgb).convert("RGB").resize(self.size, Image.BICUBIC)
        out = self.processor(images=[img], return_tensors="pt")
        pv, grid = out["pixel_values"], torch.as_tensor(out["image_grid_thw"]).long()
        t, h, w = (int(x) for x in grid[0])
        n = t * h * w // (self.merge * self.merge)
        start, pad, end = self.ids
        ids = torch.tensor([start] + [pad] * n + [end], dtype=torch.long)
        return Chunk.image(ids, pixel_values=pv.to(self.dtype), image_grid_thw=grid, id=f"frame-{frame.index}",
                           frame_index=frame.index, time_s=frame.time_s)


# ====================================================================== Qwen-style video: a chunk per temporal patch
def byte_ids(text: str, vocab: int, low: int = 10) -> list[int]:
    """A stand-in tokenizer for models without one (the tiny random models): each UTF-8 byte -> an id in
    [low, vocab), skipping the special ids below ``low``.

        byte_ids("<0.5 seconds>", 200)[:3]   # [70, 58, 56]
    """
    span = int(vocab) - int(low)
    if span < 1:
        raise WindowkitError(f"vocab {vocab} leaves no ids above {low}")
    return [int(low) + (b % span) for b in text.encode("utf-8")]


class QwenVideoEncoder:
    """Turns a Qwen-style sampled video (``agents.video_io.QwenVideo``) into position-free video chunks, one per
    temporal patch (``temporal_patch_size`` = 2 sampled frames: the unit the vision tower sees), each with its own
    M-RoPE grid ``video_grid_thw = [[1, H/P, W/P]]``.

        enc = QwenVideoEncoder(model)                                   # tiny or local Qwen2.5-VL / Qwen3-VL
        video = sample_qwen_video("clip.mp4", image_patch_size=enc.patch, fps=2.0, max_pixels=64 * 28 * 28)
        chunks = enc(video)                                              # [frame-0, frame-1, ...]

    Pixels come from transformers' own video processor (``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``,
    with the checkpoint's ``preprocessor_config.json`` mean / std when it has one), run once over the whole
    video, with ``do_resize=False`` (qwen-vl-utils already smart_resized the frames); chunk k holds rows
    [k * H*W/P², (k+1) * H*W/P²) of its ``pixel_values_videos``, which are laid out temporal patch first.

    Token ids, as the processors lay a video out:

    * Qwen2.5-VL: ``[<vision_start>] + [<video_pad>] * n + [<vision_end>]`` with ``second_per_grid_ts =
      temporal_patch_size / sample_fps`` (``Qwen2_5_VLProcessor``'s value). Every chunk is a one-patch video: the
      processor's single ``<vs> ... <ve>`` around a whole video places all its patches at the same h / w
      positions with t stepping by ``tokens_per_second * second_per_grid_ts``, which no sequence of
      position-free chunks can reproduce (docs/real-inputs.md).
    * Qwen3-VL: ``<{t:.1f} seconds>`` + ``[<vision_start>] + [<video_pad>] * n + [<vision_end>]`` per temporal
      patch, exactly ``Qwen3VLProcessor``'s layout of the whole video, so the chunks placed back to back ARE the
      processor's input. The timestamp is tokenized with ``timestamp_ids`` (default: the checkpoint's tokenizer,
      else ``byte_ids``).
    """

    def __init__(self, model: Any, model_path: Optional[str] = None,
                 timestamp_ids: Optional[Callable[[str], Sequence[int]]] = None):
        cfg = model.config
        vc = getattr(cfg, "vision_config", None)
        needed = ("video_token_id", "vision_start_token_id", "vision_end_token_id")
        family = str(getattr(cfg, "model_type", ""))
        if vc is None or family not in ("qwen2_5_vl", "qwen3_vl") or any(getattr(cfg, n, None) is None for n in needed):
            raise UnsupportedModelError(f"{type(model).__name__} ({family or 'no model_type'}) is not a Qwen2.5-VL / "
                                        f"Qwen3-VL model (needs vision_config and {', '.join(needed)})")
        self.family = family
        self.patch = int(vc.patch_size)
        self.merge = int(vc.spatial_merge_size)
        self.temporal = int(getattr(vc, "temporal_patch_size", 2))
        kw: dict = {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if model_path and os.path.isfile(os.path.join(model_path, name)):
                with open(os.path.join(model_path, name)) as f:
                    pc = json.load(f)
                kw = {k: pc[k] for k in ("image_mean", "image_std") if k in pc}
                break
        if family == "qwen3_vl":  # the video processors need torchvision (the vision extra)
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as VP
        else:
            from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor as VP
        if "cap_pixels_per_frame" in getattr(getattr(VP, "valid_kwargs", None), "__annotations__", {}):
            kw["cap_pixels_per_frame"] = False  # no effect without a resize; silences transformers' notice
        self.processor = VP(patch_size=self.patch, temporal_patch_size=self.temporal, merge_size=self.merge,
                            do_resize=False, do_sample_frames=False, **kw)
        self.ids = (int(cfg.vision_start_token_id), int(cfg.video_token_id), int(cfg.vision_end_token_id))
        self.dtype = next(model.parameters()).dtype
        if timestamp_ids is None and family == "qwen3_vl":
            timestamp_ids = self._default_timestamps(model, model_path)
        self.timestamp_ids = timestamp_ids

    @staticmethod
    def _default_timestamps(model: Any, model_path: Optional[str]) -> Callable[[str], Sequence[int]]:
        if model_path:
            try:
                tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
                return lambda s: tok(s, add_special_tokens=False)["input_ids"]
            except Exception:  # no tokenizer files: the byte stand-in below
                pass
        vocab = int(model.get_output_embeddings().weight.shape[0])
        return lambda s: byte_ids(s, vocab)

    def process(self, video: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The video processor's (pixel_values_videos [T*H*W/P², C*2*P*P], video_grid_thw [[T, H/P, W/P]]) of the
        whole video (frames already sampled and resized)."""
        out = self.processor(videos=[video.frames], return_tensors="pt")
        return out["pixel_values_videos"], torch.as_tensor(out["video_grid_thw"]).long()

    def __call__(self, video: Any) -> list[Chunk]:
        """One chunk per temporal patch, ids ``frame-<k>``; meta: ``frame_indices`` (the source frames it holds),
        ``time_s`` (the patch's timestamp), ``sample_fps``."""
        frames = video.frames
        if frames.dim() != 4 or frames.shape[1] != 3 or frames.shape[0] < 1:
            raise VideoError(f"expected frames [T, 3, H, W], got {tuple(frames.shape)}")
        factor = self.patch * self.merge
        if frames.shape[2] % factor or frames.shape[3] % factor:
            raise VideoError(f"frames are {frames.shape[3]}x{frames.shape[2]}, not multiples of {factor}: sample with "
                             f"image_patch_size={self.patch} (the model's patch size)")
        pv, grid = self.process(video)
        t, h, w = (int(x) for x in grid[0])
        rows = h * w
        if pv.shape[0] != t * rows:
            raise VideoError(f"video processor gave {pv.shape[0]} rows for grid {(t, h, w)}")
        n = rows // (self.merge * self.merge)
        start, pad, end = self.ids
        stamps = video.timestamps(self.temporal)
        idx = list(video.indices) + [video.indices[-1]] * (-len(video.indices) % self.temporal)
        secs = torch.tensor([self.temporal / float(video.sample_fps)])
        out = []
        for k in range(t):
            body = [start] + [pad] * n + [end]
            extra: dict = {}
            if self.family == "qwen3_vl":
                body = list(self.timestamp_ids(f"<{stamps[k]:.1f} seconds>")) + body
            else:
                extra["second_per_grid_ts"] = secs.clone()
            out.append(Chunk.video(torch.tensor(body, dtype=torch.long),
                                   pixel_values_videos=pv[k * rows:(k + 1) * rows].to(self.dtype),
                                   video_grid_thw=torch.tensor([[1, h, w]]), id=f"frame-{k}",
                                   frame_indices=tuple(idx[k * self.temporal:(k + 1) * self.temporal]),
                                   time_s=float(stamps[k]), sample_fps=float(video.sample_fps), **extra))
        return out


# ====================================================================== the step plan
@dataclass
class Step:
    """One agent step: the sampled-frame indices the window should hold (in order) before the question."""

    index: int
    kind: str  # "slide" | "look-back"
    frames: list[int]


def make_plan(n_frames: int, window: int, steps: Optional[int] = None, lookback_at: Iterable[int] = (),
              lookback: tuple[int, int] = (10, 8)) -> list[Step]:
    """Slide a ``window``-frame window over ``n_frames`` sampled frames (step s ends at frame s); at each
    step in ``lookback_at`` hold frames s-10..s-8 (``lookback``) first, then the most recent ones.

        make_plan(24, window=6, steps=20, lookback_at=[12])[12].frames == [2, 3, 4, 10, 11, 12]
    """
    if window < 1:
        raise WindowkitError(f"window must be >= 1 frame, got {window}")
    if n_frames < 1:
        raise VideoError("no frames to plan over")
    steps = n_frames if steps is None else int(steps)
    if not 1 <= steps <= n_frames:
        raise WindowkitError(f"steps must be in 1..{n_frames} (one step per sampled frame), got {steps}")
    far, near = int(lookback[0]), int(lookback[1])
    if not far >= near >= 1:
        raise WindowkitError(f"lookback must be (far, near) with far >= near >= 1, got {lookback}")
    back = sorted(set(int(s) for s in lookback_at))
    for s in back:
        if not far <= s < steps:
            raise WindowkitError(f"look-back step {s} must be in {far}..{steps - 1} (frames s-{far}..s-{near} exist)")
    plan = []
    for s in range(steps):
        if s in back:
            early = list(range(s - far, s - near + 1))
            n_recent = max(window - len(early), 1)
            recent = [i for i in range(s - n_recent + 1, s + 1) if i > early[-1]]
            plan.append(Step(s, "look-back", early + recent))
        else:
            plan.append(Step(s, "slide", list(range(max(0, s - window + 1), s + 1))))
    return plan


# ====================================================================== per-step questions
@dataclass
class Ask:
    """What to ask at one step (``run(..., ask=fn)``, ``fn(step) -> Ask``): the query tokens read after the
    window, and, to score the step, the right answer token and the candidates the argmax runs over.

        Ask(prompt=[q], answer=a, candidates=shape_tokens, kind="single_hop")
    """

    prompt: Sequence[int]
    answer: Optional[int] = None
    candidates: Optional[Sequence[int]] = None  # None: the argmax over the whole vocabulary
    kind: str = ""

    def correct(self, logits: torch.Tensor) -> Optional[bool]:
        if self.answer is None:
            return None
        cand = list(self.candidates) if self.candidates is not None else list(range(logits.shape[-1]))
        return cand[int(logits[cand].argmax())] == int(self.answer)


# ====================================================================== logging
@dataclass
class StepLog:
    index: int
    kind: str
    frames: list[int]
    ops: dict  # assign's edits counted by op: admit / evict / recall / reorder
    delta: dict  # win.stats deltas over the step (STAT_FIELDS) + "vision_calls"
    answer: list[int]
    window_tokens: int
    ms: float  # measured: assign + next-token forward on the patch window (generate not timed)
    prefix_cache_tokens: int = 0  # tokens a prefix cache would prefill (from the first changed chunk on)
    exact_ms: Optional[float] = None  # measured: the same step on the exact (re-prefill) window
    pc_ms: Optional[float] = None  # measured: the same step on the prefix cache (PrefixCache)
    exact_answer: Optional[list[int]] = None
    kl: Optional[float] = None  # KL(exact || patch) of the next-token distribution after the prompt
    argmax_agree: Optional[bool] = None
    question_kind: str = ""  # when the step is scored (``Ask``): "single_hop" | "multi_hop"
    correct: Optional[bool] = None  # the patch window's answer is right (argmax over the candidates)
    exact_correct: Optional[bool] = None  # the same on the exact re-prefill window
    blind_correct: Optional[bool] = None  # the same on a blind-reuse window (``blind=True``)
    blind_kl: Optional[float] = None  # KL(exact || blind)
    idle_ms: float = 0.0  # measured: ``win.flush()`` after the answer (the step's store writes, between steps)
    idle_tokens: int = 0  # prefilled between steps (``anticipate``: the next slide's survivors), not in ``delta``
    model_ms: float = 0.0  # of ``ms``: the time inside the model's calls (``BackendStats.busy_ms``); the rest is
    pc_model_ms: Optional[float] = None  # windowkit's bookkeeping. The same split of ``pc_ms``


@dataclass
class AgentReport:
    steps: list[StepLog] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # final win.stats
    vision_calls: int = 0  # final backend.stats.vision_calls (patch window's backend)
    ms_per_token: float = 0.0  # exact-window prefill ms per token (for modeled prefix-cache time)

    def totals(self) -> dict:
        return sum_deltas(self.steps, STAT_FIELDS + ("vision_calls",))

    def summary(self) -> dict:
        """Aggregates for the summary table."""
        n = len(self.steps)
        kls = [r.kl for r in self.steps if r.kl is not None]
        agree = [r.argmax_agree for r in self.steps if r.argmax_agree is not None]
        ans = [r.answer == r.exact_answer for r in self.steps if r.exact_answer is not None]
        pc_tok = sum(r.prefix_cache_tokens for r in self.steps)
        wk_tok = sum(r.delta.get("prefill_tokens", 0) for r in self.steps)
        exact_tok = sum(r.window_tokens for r in self.steps)
        return dict(steps=n, kl_mean=sum(kls) / len(kls) if kls else None, kl_max=max(kls) if kls else None,
                    argmax_agree=sum(agree) / len(agree) if agree else None,
                    answer_agree=sum(ans) / len(ans) if ans else None,
                    windowkit_prefill_tokens=wk_tok, prefix_cache_tokens=pc_tok, exact_prefill_tokens=exact_tok,
                    windowkit_ms=sum(r.ms for r in self.steps),
                    windowkit_idle_ms=sum(r.idle_ms for r in self.steps),
                    windowkit_idle_tokens=sum(r.idle_tokens for r in self.steps),
                    exact_ms=sum(r.exact_ms for r in self.steps if r.exact_ms is not None),
                    prefix_cache_ms=sum(r.pc_ms for r in self.steps if r.pc_ms is not None),
                    prefix_cache_ms_modeled=pc_tok * self.ms_per_token,
                    windowkit_ms_modeled=wk_tok * self.ms_per_token,
                    vision_calls=self.vision_calls, accuracy=self.accuracy())

    def accuracy(self) -> dict:
        """Scored steps per question kind: {kind: {"n", "windowkit", "exact", "blind"}} (fractions right;
        None where that window was not run). Empty when no step was scored."""
        out: dict = {}
        for r in self.steps:
            if r.correct is None:
                continue
            d = out.setdefault(r.question_kind or "all", {"n": 0, "windowkit": 0, "exact": 0, "blind": 0})
            d["n"] += 1
            for key, v in (("windowkit", r.correct), ("exact", r.exact_correct), ("blind", r.blind_correct)):
                d[key] = None if v is None or d[key] is None else d[key] + int(v)
        for d in out.values():
            for key in ("windowkit", "exact", "blind"):
                d[key] = None if d[key] is None else d[key] / d["n"]
        return out


def sum_deltas(steps: Sequence[Any], fields: Sequence[str]) -> dict:
    """Each of ``fields`` summed over the steps' ``delta`` dicts (a field a step lacks counts 0): a run's totals."""
    out = {k: 0 for k in fields}
    for r in steps:
        for k in out:
            out[k] += r.delta.get(k, 0)
    return out


class PrefixCache:
    """The prefix-cache baseline, run for real: keep the previous step's window KV, reuse its longest leading
    run of unchanged chunks and prefill everything after it in one forward (vLLM / SGLang prefix caching with
    the previous context cached). Exact, like re-prefill; it only saves the unchanged prefix.

        pc = PrefixCache(HFBackend(model))
        logits = pc.step([frame0, frame1, question], prompt_ids)   # next-token logits after the prompt
        pc.last_prefill_tokens                                      # tokens it ran this step (prompt excluded)
    """

    def __init__(self, backend: Any):
        self.backend = backend
        self.chunks: list[Chunk] = []
        self.spans: list[int] = []  # position span of each cached chunk (M-RoPE image spans differ from tokens)
        self.kv = None  # ChunkKV of ``chunks``, in order
        self.last_prefill_tokens = 0

    def step(self, wanted: Sequence[Chunk], prompt: torch.Tensor) -> torch.Tensor:
        wanted = list(wanted)
        k = common_prefix(self.chunks, wanted)
        n_tok = sum(len(c) for c in wanted[:k])
        past = self.kv.slice(0, n_tok) if k else None
        start = sum(self.spans[:k])
        rest = wanted[k:]
        self.last_prefill_tokens = n_rest = sum(len(c) for c in rest)
        q = Chunk.text(prompt, id="__query__")
        res = self.backend.forward(rest + [q], start, past)  # the changed suffix and the prompt: one prefill
        self.backend.forget(q)
        if rest:
            kv = res.kv.slice(0, n_rest)
            self.kv = kv if past is None else concat([past, kv])
            self.spans = self.spans[:k] + list(res.spans[:-1])
        else:
            self.kv, self.spans = past, self.spans[:k]
        self.chunks = wanted
        return res.logits


# ====================================================================== the agent
class LongVideoAgent:
    """A sliding-window video QA agent on a windowkit ``Window`` (see the module docstring).

    model:     a Qwen2.5-VL / Qwen3-VL transformers model (tiny random or a local checkpoint)
    window:    frames held per step (the question chunk comes on top)
    rank:      patch rank m; mode: "patch" | "blind" | "exact"
    reference: also run a mode="exact" window (fidelity + exact timing) and a ``PrefixCache`` (its timing)
               over the same steps
    record:    a JSONL trace path: ``run`` writes one step per plan step (the window after ``assign``, the
               answer prompt as the query); the file is rewritten by each ``run``
    prefix:    a fixed prefix (e.g. the BOS token) kept exact at the head of every window
    blind:     also run a mode="blind" window over the same steps (KL and, with ``ask``, accuracy of blind reuse)
    refresh:   a patch-refresh policy for survivors whose antecedents changed (``policies.refresh``: "always",
               "threshold:0.3", "budget:1", ...), applied after each ``assign``; None keeps them as they are
    anticipate: between steps (after the answer, off the timed step), prepare the next step's window up to its
               new frame: ``win.prefetch(next=...)`` of the next plan step's frames the agent has already seen, in
               their order (a slide's survivors with the head gone; a look-back's recalled frames, which the agent
               chooses itself, and the frames behind them; the return after it), their exact conditioned KV in
               those places. The next step then prefills only its new frame and the question. ``step`` called
               without a next step guesses a slide (``frames[1:]``). Counted apart: ``idle_ms``, ``idle_tokens``
    guess:     instead of ``anticipate``, a guess policy (``policies.guess``: "slide", or an instance) prepares the
               next step between steps from the window's history alone (``pol.apply(win)``): the agent's plan is
               not read. Its counters: ``agent.guesser.counters`` (wrong guesses' prefill: ``wasted``)
    """

    def __init__(self, model: Any, *, window: int = 6, rank: Optional[int] = 32, mode: str = "patch",
                 frame_size: tuple[int, int] = (112, 84), reference: bool = True, model_path: Optional[str] = None,
                 max_new_tokens: int = 4, record: Union[str, Path, None] = None,
                 prefix: Union[Chunk, Sequence[int], None] = None, blind: bool = False, refresh: Any = None,
                 anticipate: bool = False, guess: Any = None):
        if int(window) < 1:
            raise WindowkitError(f"window must be >= 1 frame, got {window}")
        self.window = int(window)
        self.max_new_tokens = int(max_new_tokens)
        self.encoder = FrameEncoder(model, frame_size, model_path)
        self._model, self._model_path = model, model_path
        self._video_encoder: Optional[QwenVideoEncoder] = None  # built by load_qwen_video
        self.backend = HFBackend(model)
        if prefix is not None and not isinstance(prefix, Chunk):
            prefix = Chunk.text(torch.as_tensor(list(prefix), dtype=torch.long), id="__prefix__")
        self.prefix = prefix
        self.win = Window(self.backend, rank=rank, mode=mode, prefix=prefix)
        self.ref = Window(HFBackend(model), mode="exact", prefix=prefix) if reference else None
        self.pc = PrefixCache(HFBackend(model)) if reference else None  # own backend: pays its own vision runs
        self.blind = Window(HFBackend(model), mode="blind", prefix=prefix) if blind else None
        self.refresh = make_refresh(refresh)  # PolicyError (a WindowkitError) on a bad spec
        self.record = record
        self.recorder = None  # the open TraceRecorder while ``run`` records
        self.anticipate = bool(anticipate)
        if self.anticipate and guess is not None:
            raise WindowkitError("anticipate (the agent prepares its own next step) and guess (a policy guesses it) "
                                 "exclude each other")
        self.guesser = make_guess(guess)  # PolicyError (a WindowkitError) on a bad spec

    # ------------------------------------------------------------------ input
    def load_video(self, path: str, fps: Optional[float] = 2.0, max_frames: Optional[int] = None) -> list[Chunk]:
        """Decode and sample ``path``, and turn every sampled frame into an image chunk. Raises
        ``VideoError`` (a ``ChunkError``) on a missing, unreadable or empty video; nothing is admitted."""
        frames = read_frames(path, fps=fps, max_frames=max_frames)
        return [self.encoder(f) for f in frames]

    def load_qwen_video(self, video: Any, timestamp_ids: Optional[Callable[[str], Sequence[int]]] = None,
                        **sampling: Any) -> list[Chunk]:
        """A video given the way a Qwen2.5-VL / Qwen3-VL user gives it, as position-free video chunks, one per
        temporal patch (``QwenVideoEncoder``): a path plus qwen-vl-utils sampling arguments, a video element, or
        Qwen-style messages holding one video. Frames are picked and resized by qwen-vl-utils' rules and read by
        OpenCV (``agents.video_io.sample_qwen_video``). Raises ``VideoError`` before anything is admitted.

            chunks = agent.load_qwen_video("clip.mp4", fps=2.0, max_pixels=64 * 28 * 28)
            chunks = agent.load_qwen_video([{"role": "user", "content": [{"type": "video", "video": "clip.mp4",
                                                                          "nframes": 8}]}])
        """
        if self._video_encoder is None or timestamp_ids is not None:
            self._video_encoder = QwenVideoEncoder(self._model, self._model_path, timestamp_ids)
        enc = self._video_encoder
        return enc(sample_qwen_video(video, image_patch_size=enc.patch, **sampling))

    # ------------------------------------------------------------------ running
    def run(self, frames: Sequence[Chunk], plan: Sequence[Step], question_ids: Sequence[int] = (),
            prompt_ids: Sequence[int] = (), progress: Optional[Callable[[Iterable], Iterable]] = None,
            on_step: Optional[Callable[[StepLog], None]] = None,
            on_phase: Optional[Callable[[str], None]] = None,
            ask: Optional[Callable[[Step], Ask]] = None) -> AgentReport:
        """Run every step of ``plan``; returns the per-step logs. ``progress`` wraps the step iterator
        (e.g. tqdm); ``on_step`` sees each row as soon as it is done; ``on_phase`` is told which part of a step
        starts ("windowkit", "answer", "exact", "prefix cache"): progress inside long steps.

        ``question_ids`` become a chunk at the window's tail (empty: no question chunk); ``prompt_ids`` are
        the query read after the window. ``ask(step)`` instead gives each step its own query and answer
        (``Ask``), and the step is scored: ``correct`` / ``exact_correct`` / ``blind_correct``."""
        self._on_phase = on_phase
        if not frames:
            raise VideoError("no frames to run over")
        for s in plan:
            bad = [i for i in s.frames if not 0 <= i < len(frames)]
            if bad:
                raise WindowkitError(f"step {s.index} asks for frames {bad} outside 0..{len(frames) - 1}")
        question = Chunk.text(torch.as_tensor(list(question_ids), dtype=torch.long), id="question") \
            if len(question_ids) else None
        prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        if prompt.numel() == 0 and ask is None:
            raise ChunkError("prompt_ids must hold at least one token (or pass ask=)")
        asks = {s.index: ask(s) for s in plan} if ask is not None else {}  # a bad plan fails before any edit
        for i, a in asks.items():
            if len(a.prompt) == 0:
                raise ChunkError(f"ask({i}) gave an empty prompt")
        report = AgentReport()
        prev: list[Chunk] = []
        it: Iterable = progress(plan) if progress is not None else plan
        exact_ms_tok: list[float] = []
        seen: set[int] = set()  # frames shown so far
        with recording(self, self.record):  # a failed step leaves the steps done so far in the trace
            for n, s in enumerate(it):
                a = asks.get(s.index)
                p = torch.as_tensor(list(a.prompt), dtype=torch.long) if a is not None else prompt
                seen.update(s.frames)
                guess = self.next_guess(plan[n + 1], seen, frames, question) if n + 1 < len(plan) else []
                row = self.step(s, [frames[i] for i in s.frames], question, p, prev, a, next_window=guess)
                prev = [frames[i] for i in s.frames] + ([question] if question is not None else [])
                if row.exact_ms is not None and row.window_tokens:
                    exact_ms_tok.append(row.exact_ms / row.window_tokens)
                report.steps.append(row)
                if on_step is not None:
                    on_step(row)
        report.stats = self.win.stats.as_dict()
        report.vision_calls = self.backend.stats.vision_calls
        if exact_ms_tok:
            exact_ms_tok.sort()
            report.ms_per_token = exact_ms_tok[len(exact_ms_tok) // 2]  # median: robust on a shared CPU
        return report

    @staticmethod
    def next_guess(nxt: Step, seen: set[int], frames: Sequence[Chunk], question: Optional[Chunk]) -> list[str]:
        """What the agent holds of the next step's window before its new frame arrives: the ids of ``nxt``'s
        leading frames in ``seen``, up to its first new one (then the question too, where none is new).

            LongVideoAgent.next_guess(Step(13, "slide", [8, 9, 10, 11, 12, 13]), set(range(13)), frames, q)
            # -> ids of frames 8..12
        """
        ids = []
        for i in nxt.frames:
            if i not in seen:  # the new frame: it comes from outside, after this step
                return ids
            ids.append(frames[i].id)
        return ids + ([question.id] if question is not None else [])

    def step(self, s: Step, frame_chunks: Sequence[Chunk], question: Optional[Chunk], prompt: torch.Tensor,
             prev: Sequence[Chunk] = (), ask: Optional[Ask] = None,
             next_window: Optional[Sequence[str]] = None) -> StepLog:
        """One step: ``assign`` the window, read the next-token logits and the greedy answer after ``prompt``;
        with ``ask``, score the answer on every window that runs. ``next_window``: what ``anticipate`` prepares
        between steps (ids, ``next_guess``); None: a slide's survivors (``frames[1:]``)."""
        wanted = list(frame_chunks) + ([question] if question is not None else [])
        phase = getattr(self, "_on_phase", None) or (lambda name: None)
        phase("windowkit")
        before = self.win.stats.as_dict()
        vc0, busy0 = self.backend.stats.vision_calls, self.backend.stats.busy_ms
        t0 = time.perf_counter()
        edits = self.win.assign(wanted)
        if self.refresh is not None:  # fresh conditioning for drifted survivors (counted as patch forms)
            edits = edits + [("refresh", cid) for cid in self.refresh.apply(self.win)]
        logits = self.win.forward(prompt)  # materializes the window: relocations happen here
        ms = (time.perf_counter() - t0) * 1e3
        model_ms = self.backend.stats.busy_ms - busy0
        if self.recorder is not None:  # once per step, outside the timed part
            self.recorder.record(self.win, query_tokens=int(prompt.numel()))
        phase("answer")
        answer = self.win.generate(prompt, max_new_tokens=self.max_new_tokens)
        after = self.win.stats.as_dict()  # the step's own spending (the idle work below is counted apart)
        t_idle = time.perf_counter()
        self.win.flush()  # between steps: the conditioned copies this step keeps go to the store now
        idle_tokens = 0
        if self.anticipate:  # the next window up to its new frame (by default a slide's survivors), now
            guess = [c.id for c in frame_chunks[1:]] if next_window is None else list(next_window)
            if guess:
                idle_tokens = self.win.prefetch(next=guess)["prefilled"]
        elif self.guesser is not None:  # after a run's last step (no next window): only score the last guess
            if next_window is not None and not next_window:
                self.guesser.observe(self.win.ids)
            else:
                idle_tokens = self.guesser.apply(self.win)["prefilled"]
        idle_ms = (time.perf_counter() - t_idle) * 1e3
        delta = {k: after[k] - before[k] for k in STAT_FIELDS}
        delta["vision_calls"] = self.backend.stats.vision_calls - vc0
        ops: dict = {}
        for op, _ in edits:
            ops[op] = ops.get(op, 0) + 1
        row = StepLog(s.index, s.kind, list(s.frames), ops, delta, answer, sum(len(c) for c in wanted), ms,
                      prefix_cache_tokens=common_prefix_tokens(list(prev), wanted), idle_ms=idle_ms,
                      idle_tokens=idle_tokens, model_ms=model_ms)
        if ask is not None:
            row.question_kind, row.correct = ask.kind, ask.correct(logits)
        if self.ref is not None:
            phase("exact")
            t1 = time.perf_counter()
            self.ref.assign(wanted)
            ref_logits = self.ref.forward(prompt)  # one full re-prefill of the window (+ the prompt)
            row.exact_ms = (time.perf_counter() - t1) * 1e3  # assign + forward, as ``ms``
            row.exact_answer = self.ref.generate(prompt, max_new_tokens=self.max_new_tokens)  # reuses that prefill
            row.kl = kl_divergence(ref_logits, logits)
            row.argmax_agree = int(ref_logits.argmax()) == int(logits.argmax())
            if ask is not None:
                row.exact_correct = ask.correct(ref_logits)
        if self.blind is not None:
            phase("blind")
            self.blind.assign(wanted)
            blind_logits = self.blind.forward(prompt)
            if ask is not None:
                row.blind_correct = ask.correct(blind_logits)
            if self.ref is not None:
                row.blind_kl = kl_divergence(ref_logits, blind_logits)
        if self.pc is not None:
            phase("prefix cache")
            busy = self.pc.backend.stats.busy_ms
            t2 = time.perf_counter()
            # reuse the unchanged leading chunks, prefill the rest + the prompt
            self.pc.step(([self.prefix] if self.prefix is not None else []) + wanted, prompt)
            row.pc_ms = (time.perf_counter() - t2) * 1e3
            row.pc_model_ms = self.pc.backend.stats.busy_ms - busy
        return row


# ====================================================================== tables
def format_step_table(rows: Sequence[StepLog], header: bool = True) -> str:
    cols = ("step", "kind", "frames", "ops", "enc", "vis", "forms", "apply", "reuse", "reloc", "prefill", "pc_tok",
            "ms", "pc_ms", "exact_ms", "KL", "agree", "right", "answer")
    lines = []
    if header:
        lines.append(" ".join(f"{c:>8}" if i not in _W else f"{c:<{_W[i]}}" for i, c in enumerate(cols)))
    for r in rows:
        lines.append(format_step_row(r))
    return "\n".join(lines)


_W = {1: 9, 2: 16, 3: 22, 17: 10, 18: 16}


def format_step_row(r: StepLog) -> str:
    d = r.delta
    frames = _ranges(r.frames)
    ops = " ".join(f"{k}{v}" for k, v in sorted(r.ops.items()))
    vals = [f"{r.index:>8}", f"{r.kind:<9}", f"{frames:<16}", f"{ops:<22}", f"{d['encodes']:>8}",
            f"{d['vision_calls']:>8}", f"{d['patch_forms']:>8}", f"{d['patch_applies']:>8}", f"{d['patch_reuses']:>8}",
            f"{d['relocations']:>8}", f"{d['prefill_tokens']:>8}", f"{r.prefix_cache_tokens:>8}", f"{r.ms:>8.1f}",
            f"{r.pc_ms:>8.1f}" if r.pc_ms is not None else f"{'-':>8}",
            f"{r.exact_ms:>8.1f}" if r.exact_ms is not None else f"{'-':>8}",
            f"{r.kl:>8.1e}" if r.kl is not None else f"{'-':>8}",
            f"{('yes' if r.argmax_agree else 'NO'):>8}" if r.argmax_agree is not None else f"{'-':>8}",
            f"{_right(r):<10}", f"{r.answer}"]
    return " ".join(vals)


def _right(r: StepLog) -> str:
    """"M 1/1/0": question kind (S single-hop, M multi-hop), then right (1) or wrong (0) on the windowkit /
    exact / blind windows ("-" where one did not run); "-" when the step is not scored."""
    if r.correct is None:
        return "-"
    marks = "/".join("-" if v is None else str(int(v)) for v in (r.correct, r.exact_correct, r.blind_correct))
    return f"{(r.question_kind[:1] or '?').upper()} {marks}"


def _ranges(idx: Sequence[int]) -> str:
    out, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(f"{idx[i]}" if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ",".join(out)


def format_summary(report: AgentReport) -> str:
    s = report.summary()
    t = report.totals()
    ops: dict = {}
    for r in report.steps:
        for k, v in r.ops.items():
            ops[k] = ops.get(k, 0) + v
    by_kind: dict = {}
    for r in report.steps:
        by_kind.setdefault(r.kind, []).append(r)

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    def ratio(a, b):
        return a / b if b else None

    lines = ["| quantity | value |", "|---|---:|",
             f"| steps (slide / look-back) | {len(by_kind.get('slide', []))} / {len(by_kind.get('look-back', []))} |",
             f"| window edits | {', '.join(f'{k} {v}' for k, v in sorted(ops.items()))} |",
             f"| encodes / vision tower calls | {t['encodes']} / {t['vision_calls']} |",
             f"| patches formed / applied / reused | {t['patch_forms']} / {t['patch_applies']} / {t['patch_reuses']} |",
             f"| relocations | {t['relocations']} |",
             f"| next-token KL vs exact: mean / max | {f(s['kl_mean'], '.2e')} / {f(s['kl_max'], '.2e')} |",
             f"| argmax agreement / answer agreement | {f(s['argmax_agree'], '.0%')} / {f(s['answer_agree'], '.0%')} |",
             f"| prefill tokens: windowkit / prefix cache / exact re-prefill | {s['windowkit_prefill_tokens']} / "
             f"{s['prefix_cache_tokens']} / {s['exact_prefill_tokens']} |",
             f"| modeled prefill ms (at {report.ms_per_token:.3f} ms/token): windowkit / prefix cache | "
             f"{s['windowkit_ms_modeled']:.0f} / {s['prefix_cache_ms_modeled']:.0f} |",
             f"| measured ms: windowkit / prefix cache / exact re-prefill | {s['windowkit_ms']:.0f} / "
             f"{s['prefix_cache_ms']:.0f} / {s['exact_ms']:.0f} |",
             f"| time vs the prefix cache, windowkit / prefix cache: measured / modeled | "
             f"{f(ratio(s['windowkit_ms'], s['prefix_cache_ms']), '.2f')} / "
             f"{f(ratio(s['windowkit_ms_modeled'], s['prefix_cache_ms_modeled']), '.2f')} |",
             f"| est_ms_saved (win.stats) | {t['est_ms_saved']:.0f} |"]
    if s["windowkit_idle_tokens"]:  # anticipate=True: the next slide prepared between steps (not in the step)
        lines.append(f"| between steps (each next step prepared): prefill tokens / ms | "
                     f"{s['windowkit_idle_tokens']} / {s['windowkit_idle_ms']:.0f} |")
    bkl = [r.blind_kl for r in report.steps if r.blind_kl is not None]
    if bkl:
        lines.append(f"| next-token KL vs exact, blind reuse: mean / max | {sum(bkl) / len(bkl):.2e} / {max(bkl):.2e} |")
    for kind, d in sorted(s["accuracy"].items()):
        lines.append(f"| accuracy, {kind} ({d['n']} steps): windowkit / exact re-prefill / blind | "
                     f"{f(d['windowkit'], '.3f')} / {f(d['exact'], '.3f')} / {f(d['blind'], '.3f')} |")
    return "\n".join(lines)


def lookback_steps(spec: str, steps: int, far: int = 10) -> list[int]:
    """The look-back steps of a CLI spec: "auto" (two, late in the run), "" (none) or "12,16". ``far`` is
    how far back a look-back reaches (``make_plan``'s ``lookback[0]``): "auto" picks no step before it.

        lookback_steps("auto", 18)   # [12, 16]
    """
    if spec == "auto":
        return [s for s in sorted({(2 * steps) // 3, steps - 2}) if s >= far]
    return [int(x) for x in spec.split(",") if x.strip()]


def sample_video(agent: "LongVideoAgent", video: Optional[str], fps: float, max_frames: int) -> list:
    """``agent.load_video`` of ``video``, or of a synthetic OpenCV video (96x72 @ 8 fps, moving coloured
    shapes) long enough for ``max_frames`` frames at ``fps`` when ``video`` is None."""
    with tempfile.TemporaryDirectory(prefix="wk-video-") as tmp:
        if video is None:
            video = write_synthetic_video(os.path.join(tmp, "shapes.avi"), n_frames=int(max_frames * 8 / fps) + 1,
                                          fps=8.0, size=(96, 72))
        return agent.load_video(video, fps=fps, max_frames=max_frames)


# ====================================================================== the binding model's video
#: look-back reach for the binding video: frames s-11, s-10 and s carry three different tags (t mod 3)
BINDING_LOOKBACK = (11, 10)


def binding_video(n_frames: int, seed: int = 0) -> tuple[list[Chunk], Callable[[Step], Ask], list[int]]:
    """The binding model's synthetic video as the agent's inputs: (frame chunks, ``ask`` for ``run``, the
    prefix ids [BOS]). Each step asks about its own window (``task.window_question``): "which object changed
    shape in the newest frame?" where the window is a multi-hop item, else the shape of one object in one
    of its frames; the step is scored against the drawn truth.

        frames, ask, prefix = binding_video(48)
        agent = LongVideoAgent(load_model("binding"), window=3, prefix=prefix, blind=True)
        report = agent.run(frames, make_plan(48, 3, lookback=BINDING_LOOKBACK), ask=ask)
    """
    video = task.make_video(seed, n_frames)
    chunks = [task.video_chunk(video, t) for t in range(n_frames)]

    def ask(s: Step) -> Ask:
        q = task.window_question(video, s.frames, seed)
        return Ask(q.ids, q.answer, q.candidates, q.kind)

    return chunks, ask, [task.BOS]


__all__ = ["Ask", "binding_video", "BINDING_LOOKBACK", "FrameEncoder", "Step", "make_plan", "lookback_steps", "sample_video", "StepLog", "AgentReport", "PrefixCache", "LongVideoAgent",
           "STAT_FIELDS", "QwenVideoEncoder", "byte_ids",
           "format_step_table", "format_step_row", "format_summary"]
