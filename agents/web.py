"""A web/GUI agent window on a windowkit ``Window``: a task chunk, then the last ``k`` screenshots.

    from agents.web import WebAgent, synthetic_screenshot
    agent = WebAgent(model, window=3)                                # a Qwen2.5-VL / Qwen3-VL model
    shots = [synthetic_screenshot(i, agent.viewport) for i in range(8)]
    report = agent.run(shots, task_ids, planner_ids, grounder_ids)
    for row in report.steps: print(row.admitted, row.evicted, row.delta, row.plan)

The window is kept as WebVoyager keeps its context: the task text chunk first, then the last ``window``
screenshots (older ones evicted; the task chunk never moves, the surviving screenshots only relocate). With
``clip=`` (WebVoyager's own rule) a screenshot that leaves the last ``window`` is not dropped but clipped to its
text where it stood (``text-<i>``: its thought / action / page text, token ids from ``clip(i)``), so the window
is [task, text-0 .. text-(t-window), last ``window`` screenshots]. With ``anticipate=True`` the agent writes that
clip between steps (after the grounder, off the timed step) and prepares the next window with it:
``win.prefetch(next=[task, *texts, clip, *shots[1:]])``. The next step then prefills only its new screenshot.
Each step runs two model calls on the SAME window, which ``forward`` / ``generate`` leave unchanged:

* planner:  ``win.generate(planner_ids, max_new_tokens)`` (the next action, greedy);
* grounder: ``win.forward(grounder_ids)`` (next-token logits: where to click).

Both read the same screenshot chunks, so the vision tower runs once per screenshot, when it is admitted
(``backend.stats.vision_calls`` and ``win.stats.vision_calls``), never for the second call.

Screenshots are PIL images (or uint8 [H, W, 3] arrays) of a fixed viewport size; each becomes an image chunk
through ``agents.long_video.FrameEncoder`` (transformers' ``Qwen2VLImageProcessorPil``, config token ids).
A screenshot of another size raises ``ScreenshotError`` (a ``windowkit.ChunkError``) before any window edit.

With ``record=PATH`` each step's window (task + screenshots, in order) is appended to a JSONL trace
(``windowkit.trace.TraceRecorder``); its query size is the planner plus the grounder prompt, the two calls
that read the window.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from agents.common import common_prefix_tokens
from agents.long_video import FrameEncoder, sum_deltas
from agents.video_io import Frame
from windowkit.backends.hf import HFBackend
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError, WindowkitError
from windowkit.kv.metrics import kl_divergence
from windowkit.trace.record import recording
from windowkit.window import Window

#: ``win.stats`` fields logged per step (deltas); ``vision_calls`` is the backend's delta
STAT_FIELDS = ("encodes", "patch_forms", "patch_reuses", "patch_applies", "relocations", "prefill_tokens",
               "reused_tokens", "forwards", "fallbacks", "vision_calls")


class ScreenshotError(ChunkError):
    """A screenshot is not an RGB image of the agent's viewport size."""


# ====================================================================== synthetic screenshots
_BUTTONS = ("Search", "Cart", "Login", "Next")
_BOX = [(220, 60, 60), (60, 160, 60), (60, 90, 220), (230, 170, 30)]


def synthetic_screenshot(i: int, size: tuple[int, int] = (168, 112)) -> Any:
    """Step ``i``'s fake page (a PIL RGB image of ``size`` = (w, h)): a header bar with a title, a row of
    buttons with text, a text line, and a coloured box that moves and changes colour every step."""
    from PIL import Image, ImageDraw

    w, h = int(size[0]), int(size[1])
    img = Image.new("RGB", (w, h), (245, 245, 245))
    d = ImageDraw.Draw(img)
    hb = max(8, h // 7)
    d.rectangle([0, 0, w - 1, hb], fill=(40, 60, 120))
    d.text((3, 1), f"shop.example/p{i}", fill=(255, 255, 255))
    bw = max(10, (w - 10) // len(_BUTTONS))
    for k, name in enumerate(_BUTTONS):
        x0, y0 = 4 + k * bw, hb + 4
        d.rectangle([x0, y0, x0 + bw - 6, y0 + 12], fill=(200, 200, 210), outline=(90, 90, 90))
        d.text((x0 + 2, y0 + 1), name, fill=(0, 0, 0))
    d.text((4, hb + 22), f"results: {3 * i + 7}", fill=(30, 30, 30))
    s = max(6, min(w, h) // 6)
    bx = 4 + (i * 23) % max(1, w - s - 8)
    by = hb + 36 + (i * 11) % max(1, h - hb - s - 40)
    d.rectangle([bx, by, bx + s, by + s], fill=_BOX[i % len(_BOX)])
    return img


# ====================================================================== logging
@dataclass
class WebStepLog:
    index: int
    screenshots: list[str]  # screenshot ids held this step, in window order (after the task chunk)
    admitted: list[str]
    evicted: list[str]
    delta: dict  # win.stats deltas over the whole step (STAT_FIELDS); vision_calls from the backend
    between: dict  # encodes / vision_calls / prefill_tokens run between the planner and the grounder call
    plan: list[int]  # the planner's greedy tokens
    grounder_top: int  # argmax of the grounder's next-token logits
    window_tokens: int
    prefix_cache_tokens: int  # tokens a prefix cache would re-prefill (from the first changed chunk on)
    ms: float  # assign + planner + grounder on the patch window
    kl: Optional[float] = None  # KL(exact || patch) of the planner's next-token distribution
    argmax_agree: Optional[bool] = None
    texts: list[str] = field(default_factory=list)  # clipped observations held (``clip=``), between task and shots
    idle_tokens: int = 0  # prefilled between steps (``anticipate``: the next window prepared), not in ``delta``
    idle_ms: float = 0.0

    @property
    def ids(self) -> list[str]:
        """The window this step read, in order."""
        return ["task"] + self.texts + self.screenshots


@dataclass
class WebReport:
    steps: list[WebStepLog] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # final win.stats
    vision_calls: int = 0  # final backend.stats.vision_calls
    distinct_screenshots: int = 0

    def totals(self) -> dict:
        return sum_deltas(self.steps, STAT_FIELDS)

    def summary(self) -> dict:
        kls = [r.kl for r in self.steps if r.kl is not None]
        agree = [r.argmax_agree for r in self.steps if r.argmax_agree is not None]
        return dict(steps=len(self.steps), vision_calls=self.vision_calls, distinct_screenshots=self.distinct_screenshots,
                    kl_mean=sum(kls) / len(kls) if kls else None, kl_max=max(kls) if kls else None,
                    argmax_agree=sum(agree) / len(agree) if agree else None,
                    windowkit_prefill_tokens=sum(r.delta["prefill_tokens"] for r in self.steps),
                    prefix_cache_tokens=sum(r.prefix_cache_tokens for r in self.steps),
                    exact_prefill_tokens=sum(r.window_tokens for r in self.steps),
                    windowkit_ms=sum(r.ms for r in self.steps),
                    windowkit_idle_tokens=sum(r.idle_tokens for r in self.steps),
                    windowkit_idle_ms=sum(r.idle_ms for r in self.steps))


# ====================================================================== the agent
class WebAgent:
    """A WebVoyager-style screenshot window on a windowkit ``Window`` (see the module docstring).

    model:     a Qwen2.5-VL / Qwen3-VL transformers model (tiny random or a local checkpoint)
    window:    screenshots held per step (the task chunk comes first)
    viewport:  (w, h) every screenshot must have; rounded to multiples of patch x merge at construction
    rank, mode, form: passed to ``Window`` (docs/window.md; form None: the Window's default, lazy forming)
    reference: also keep a mode="exact" window over the same contents (fidelity of the planner's logits)
    record:    a JSONL trace path: ``run`` writes one step per screenshot (the file is rewritten by each ``run``)
    clip:      ``clip(i) -> token ids`` of screenshot i's text: a screenshot leaving the last ``window`` turns into
               that text chunk (``text-<i>``) where it stood (WebVoyager's context rule); None: it is evicted
    anticipate: between steps (after the grounder, off the timed step), prepare the next window without its new
               screenshot, the coming clip included: ``win.prefetch(next=...)``. Counted apart: ``idle_tokens``,
               ``idle_ms``

        agent = WebAgent(model, window=3, clip=lambda i: tok(f"Step {i}: clicked Search."), anticipate=True)
    """

    def __init__(self, model: Any, *, window: int = 3, viewport: tuple[int, int] = (168, 112),
                 rank: Optional[int] = 32, mode: str = "patch", form: Optional[str] = None, reference: bool = True,
                 model_path: Optional[str] = None, max_new_tokens: int = 4, record: Union[str, Path, None] = None,
                 clip: Optional[Callable[[int], Sequence[int]]] = None, anticipate: bool = False):
        if int(window) < 1:
            raise WindowkitError(f"window must be >= 1 screenshot, got {window}")
        if clip is not None and not callable(clip):
            raise WindowkitError(f"clip must be a callable index -> token ids, got {type(clip).__name__}")
        self.window = int(window)
        self.max_new_tokens = int(max_new_tokens)
        self.encoder = FrameEncoder(model, viewport, model_path)
        self.viewport = self.encoder.size  # the rounded (w, h): screenshots are never resized
        self.backend = HFBackend(model)
        self.win = Window(self.backend, rank=rank, mode=mode, **({"form": form} if form is not None else {}))
        if anticipate and (self.win.form != "lazy" or self.win.mode != "patch"):
            raise WindowkitError("anticipate=True prepares exact conditioned copies, which only a form='lazy', "
                                 f"mode='patch' Window keeps (got form={self.win.form!r}, mode={self.win.mode!r})")
        self.ref = Window(HFBackend(model), mode="exact") if reference else None
        self.task: Optional[Chunk] = None
        self.shots: list[Chunk] = []  # every screenshot seen, in order
        self._prev: list[Chunk] = []
        self.record = record
        self.recorder = None  # the open TraceRecorder while ``run`` records
        self.clip, self.anticipate = clip, bool(anticipate)
        self._clips: dict[int, Chunk] = {}  # screenshot index -> its text chunk, made once

    # ------------------------------------------------------------------ input
    def screenshot_chunk(self, image: Any, index: int) -> Chunk:
        """One screenshot as an image chunk ``shot-<index>``. Raises ``ScreenshotError`` unless ``image`` is an
        RGB image (PIL or uint8 [H, W, 3]) of exactly ``self.viewport``; builds nothing else."""
        from PIL import Image

        if isinstance(image, np.ndarray):
            if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
                raise ScreenshotError(f"screenshot {index}: an array must be uint8 [H, W, 3], got "
                                      f"{image.dtype} {tuple(image.shape)}")
            image = Image.fromarray(image)
        if not isinstance(image, Image.Image):
            raise ScreenshotError(f"screenshot {index}: expected a PIL image or uint8 array, got {type(image).__name__}")
        if tuple(image.size) != tuple(self.viewport):
            raise ScreenshotError(f"screenshot {index} is {image.size[0]}x{image.size[1]}, the agent's viewport is "
                                  f"{self.viewport[0]}x{self.viewport[1]} (screenshots are not resized)")
        c = self.encoder(Frame(index, float(index), np.asarray(image.convert("RGB"))))
        c.id = f"shot-{index}"
        return c

    def clip_chunk(self, index: int) -> Chunk:
        """Screenshot ``index`` clipped to its text (``clip(index)``), as the text chunk ``text-<index>`` (made once)."""
        c = self._clips.get(index)
        if c is None:
            ids = torch.as_tensor(list(self.clip(index)), dtype=torch.long)
            if ids.dim() != 1 or ids.numel() == 0:
                raise ChunkError(f"clip({index}) must give a non-empty list of token ids")
            c = self._clips[index] = Chunk.text(ids, id=f"text-{index}")
        return c

    def context(self, shots: Sequence[Chunk]) -> list[Chunk]:
        """The window over the screenshots ``shots`` seen so far: the task, the clips of those older than the last
        ``window`` (with ``clip=``), then the last ``window`` screenshots."""
        cut = max(0, len(shots) - self.window)
        texts = [self.clip_chunk(i) for i in range(cut)] if self.clip is not None else []
        return [self.task] + texts + list(shots[cut:])

    # ------------------------------------------------------------------ running
    def start(self, task_ids: Sequence[int]) -> None:
        """Set the task chunk (first in the window from the next step on)."""
        self.task = Chunk.text(torch.as_tensor(list(task_ids), dtype=torch.long), id="task")

    def step(self, image: Any, planner_ids: Sequence[int], grounder_ids: Sequence[int]) -> WebStepLog:
        """Admit one new screenshot (evicting the oldest beyond ``window``), then run the planner and the
        grounder on the same window. A bad screenshot raises before any edit: the window is unchanged."""
        if self.task is None:
            raise WindowkitError("call start(task_ids) before step()")
        planner = torch.as_tensor(list(planner_ids), dtype=torch.long)
        grounder = torch.as_tensor(list(grounder_ids), dtype=torch.long)
        if planner.numel() == 0 or grounder.numel() == 0:
            raise ChunkError("planner_ids and grounder_ids must hold at least one token")
        index = len(self.shots)
        shot = self.screenshot_chunk(image, index)  # may raise: nothing edited yet
        held = (self.shots + [shot])[-self.window:]
        wanted = self.context(self.shots + [shot])  # a bad clip raises here: nothing edited yet
        before = self.win.stats.as_dict()
        vc0 = self.backend.stats.vision_calls
        t0 = time.perf_counter()
        edits = self.win.assign(wanted)
        self.shots.append(shot)
        logits = self.win.forward(planner)  # materializes the window (relocations happen here)
        plan = self.win.generate(planner, max_new_tokens=self.max_new_tokens)
        mid = self.win.stats.as_dict()
        vc_mid = self.backend.stats.vision_calls
        g_logits = self.win.forward(grounder)  # same window, same chunks: no vision run, no encode
        ms = (time.perf_counter() - t0) * 1e3
        if self.recorder is not None:  # once per step, outside the timed part: the window both calls read
            self.recorder.record(self.win, query_tokens=int(planner.numel() + grounder.numel()))
        after = self.win.stats.as_dict()
        delta = {k: after[k] - before[k] for k in STAT_FIELDS if k != "vision_calls"}
        delta["vision_calls"] = self.backend.stats.vision_calls - vc0
        between = {"encodes": after["encodes"] - mid["encodes"],
                   "vision_calls": self.backend.stats.vision_calls - vc_mid,
                   "prefill_tokens": after["prefill_tokens"] - mid["prefill_tokens"]}
        row = WebStepLog(index, [c.id for c in held], [cid for op, cid in edits if op in ("admit", "recall")],
                         [cid for op, cid in edits if op == "evict"], delta, between, plan, int(g_logits.argmax()),
                         sum(len(c) for c in wanted), common_prefix_tokens(self._prev, wanted), ms,
                         texts=[c.id for c in wanted[1:len(wanted) - len(held)]])
        self._prev = wanted
        if self.anticipate and len(held) == self.window:  # the next screenshot pushes the oldest out
            t_idle = time.perf_counter()
            nxt = self.context(self.shots + [None])[:-1]  # the next window without its (unknown) new screenshot
            row.idle_tokens = self.win.prefetch(next=[c if c.id not in self.win else c.id for c in nxt])["prefilled"]
            row.idle_ms = (time.perf_counter() - t_idle) * 1e3
        if self.ref is not None:
            self.ref.assign(wanted)
            ref_logits = self.ref.forward(planner)
            row.kl = kl_divergence(ref_logits, logits)
            row.argmax_agree = int(ref_logits.argmax()) == int(logits.argmax())
        return row

    def run(self, images: Sequence[Any], task_ids: Sequence[int], planner_ids: Sequence[int],
            grounder_ids: Sequence[int], on_step: Optional[Callable[[WebStepLog], None]] = None) -> WebReport:
        """Start the task and run one step per screenshot; returns the per-step logs."""
        self.start(task_ids)
        report = WebReport()
        with recording(self, self.record):  # a failed step leaves the steps done so far in the trace
            for img in images:
                row = self.step(img, planner_ids, grounder_ids)
                report.steps.append(row)
                if on_step is not None:
                    on_step(row)
        report.stats = self.win.stats.as_dict()
        report.vision_calls = self.backend.stats.vision_calls
        report.distinct_screenshots = len({c.content_hash() for c in self.shots})
        return report


# ====================================================================== tables
def format_step_header() -> str:
    return (f"{'step':>4} {'held':<14} {'admitted':<10} {'evicted':<8} {'enc':>4} {'vis':>4} {'forms':>5} {'reloc':>5} "
            f"{'prefill':>7} {'pc_tok':>6} {'exact':>6} {'ms':>7} {'KL':>8} {'agree':>5} plan")


def format_step_row(r: WebStepLog) -> str:
    d = r.delta

    def short(ids):
        return ",".join(s.replace("shot-", "s") for s in ids) or "-"

    kl = f"{r.kl:>8.1e}" if r.kl is not None else f"{'-':>8}"
    agree = ("yes" if r.argmax_agree else "NO") if r.argmax_agree is not None else "-"
    return (f"{r.index:>4} {short(r.screenshots):<14} {short(r.admitted):<10} {short(r.evicted):<8} "
            f"{d['encodes']:>4} {d['vision_calls']:>4} {d['patch_forms']:>5} {d['relocations']:>5} "
            f"{d['prefill_tokens']:>7} {r.prefix_cache_tokens:>6} {r.window_tokens:>6} {r.ms:>7.1f} {kl} {agree:>5} "
            f"{r.plan}")


def format_summary(report: WebReport) -> str:
    s, t = report.summary(), report.totals()

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    return "\n".join([
        "| quantity | value |", "|---|---:|",
        f"| steps | {s['steps']} |",
        f"| vision tower calls / distinct screenshots | {s['vision_calls']} / {s['distinct_screenshots']} |",
        f"| encodes / patches formed / relocations | {t['encodes']} / {t['patch_forms']} / {t['relocations']} |",
        f"| extra encodes / vision calls for the grounder | "
        f"{sum(r.between['encodes'] for r in report.steps)} / {sum(r.between['vision_calls'] for r in report.steps)} |",
        f"| prefill tokens: windowkit / prefix cache / exact re-prefill | {s['windowkit_prefill_tokens']} / "
        f"{s['prefix_cache_tokens']} / {s['exact_prefill_tokens']} |",
        f"| planner next-token KL vs exact: mean / max | {f(s['kl_mean'], '.2e')} / {f(s['kl_max'], '.2e')} |",
        f"| planner argmax agreement | {f(s['argmax_agree'], '.0%')} |",
        f"| measured ms (windowkit steps) | {s['windowkit_ms']:.0f} |"]
        + ([f"| between steps (the next window prepared): prefill tokens / ms | {s['windowkit_idle_tokens']} / "
            f"{s['windowkit_idle_ms']:.0f} |"] if s["windowkit_idle_tokens"] else []))


__all__ = ["ScreenshotError", "synthetic_screenshot", "WebStepLog", "WebReport", "WebAgent", "STAT_FIELDS",
           "format_step_header", "format_step_row", "format_summary"]
