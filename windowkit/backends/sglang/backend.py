"""SGLangBackend: windowkit's Backend protocol with queries served by an SGLang ``Engine``.

SGLang's Engine never hands KV back to its caller, so the KV-producing work a Window does (canonical
encodes, conditioned forwards, patches) runs on ``kv_backend``, an ``HFBackend`` over the same weights;
every protocol method the Window calls (``layout``, ``rope``, ``positions``, ``span``, ``forward``,
``make_cache``, ``check_kv``, ``fingerprint``, ``forget``...) is that backend's. What SGLang serves is the
query over the window: ``serve`` turns the window's materialized KV into a page-aligned plan
(``WindowPlan``), sends it with the request (``custom_params``, ``cache_salt``, ``rid``), and the
windowkit linker inside SGLang writes it into the KV pool so that only the query (and any tail that does
not fill a page) is prefilled.

    backend = SGLangBackend.launch("/models/qwen2-7b", kv_backend=HFBackend(model), page_size=16,
                                   spool_dir="/dev/shm/wk")          # needs a CUDA GPU
    win = Window(backend, rank=32); win.admit(Chunk.text(a)); win.admit(Chunk.text(b))
    out = backend.serve(win, query_ids, sampling_params={"max_new_tokens": 32})

The plan-building core (``plan_request``) needs neither a GPU nor an engine and is tested on CPU against
SGLang's pool classes (tests/test_sglang_linker.py).
"""
from __future__ import annotations

import itertools
import json
import os
import tempfile
from typing import Any, Optional, Sequence

import torch

from windowkit.backends.base import ForwardResult
from windowkit.backends.sglang.cpu_engine import CPUEngine
from windowkit.backends.sglang.plan import PLAN_KEY, Segment, SegMode, WindowPlan
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError, UnsupportedModelError
from windowkit.kv.layout import ChunkKV
from windowkit.kv.rope import RopeSpec

_counter = itertools.count()


def linker_config(fingerprint: Optional[str] = None, stats_path: Optional[str] = None, **extra: Any) -> dict:
    """The ``--unified-cache-external-linker-config`` object that loads ``WindowkitLinker`` (``extra``: more
    ``linker_extra_config`` keys, e.g. ``model_fingerprint``, ``tp_rank``)."""
    extra = dict(extra)
    if fingerprint:
        extra["model_fingerprint"] = fingerprint
    if stats_path:
        extra["stats_path"] = stats_path
    return {"linker": "WindowkitLinker", "linker_module_path": "windowkit.backends.sglang.linker",
            "linker_extra_config": extra}


def plan_request(kv: ChunkKV, window_ids: Sequence[int], query_ids: Sequence[int], *, page_size: int,
                 fingerprint: str, mode: SegMode = "approx", segments: Optional[Sequence[Segment]] = None,
                 spool_dir: Optional[str] = None, src_pairing: str = "half", pool_pairing: str = "half",
                 share_exact: bool = True, sampling_params: Optional[dict] = None,
                 rid: Optional[str] = None) -> tuple[WindowPlan, dict]:
    """The plan for a window's KV and the ``Engine.generate`` keyword arguments that carry it.

    The prompt is ``window_ids + query_ids``. The plan covers the window's whole pages; the rest of the
    window and the query are prefilled by SGLang. Returns ``(plan, kwargs)``.
    """
    window_ids = [int(t) for t in window_ids]
    if kv.num_tokens != len(window_ids):
        raise ChunkError(f"window KV holds {kv.num_tokens} tokens but the window has {len(window_ids)} token ids")
    if len(query_ids) == 0:
        raise ChunkError("the query must hold at least one token (SGLang computes the last prompt token itself)")
    plan = WindowPlan.build(kv, window_ids, page_size=page_size, fingerprint=fingerprint, segments=segments,
                            mode=mode, spool_dir=spool_dir, src_pairing=src_pairing, pool_pairing=pool_pairing,
                            share_exact=share_exact)
    sp = dict(sampling_params or {"max_new_tokens": 1, "temperature": 0.0})
    custom = dict(sp.get("custom_params") or {})
    custom[PLAN_KEY] = json.dumps(plan.to_json())  # a JSON string: custom_params values must be flat
    sp["custom_params"] = custom
    kwargs = {"input_ids": window_ids + [int(t) for t in query_ids], "sampling_params": sp,
              "rid": rid or f"{plan.plan_id}-{os.getpid()}-{next(_counter)}"}
    if plan.cache_salt is not None:
        kwargs["cache_salt"] = plan.cache_salt
    return plan, kwargs


def window_token_ids(window: Any) -> list[int]:
    """The token ids of a Window (prefix, then its chunks in window order); text chunks only."""
    parts = [window.prefix] if getattr(window, "prefix", None) is not None else []
    parts += [window.chunk(i) for i in window.ids]
    ids: list[int] = []
    for c in parts:
        if c.has_vision:
            raise ChunkError(f"chunk {c.id!r} carries pixels: SGLangBackend.serve handles text windows only")
        ids += [int(t) for t in c.input_ids.reshape(-1)]
    return ids


class SGLangBackend:
    """windowkit Backend whose queries run on an SGLang Engine, with the window restored by the linker.

    engine:     an ``sglang.Engine`` started with the windowkit linker (see ``launch``)
    kv_backend: the backend that produces KV (an ``HFBackend`` over the same weights)
    page_size:  the engine's ``--page-size``
    spool_dir:  where plans' KV go as safetensors files (the scheduler runs in another process)
    """

    def __init__(self, engine: Any, kv_backend: Any, *, page_size: int, spool_dir: Optional[str] = None,
                 config: Any = None, share_exact: bool = True):
        self.engine = engine
        self.kv_backend = kv_backend
        self.page_size = int(page_size)
        self.spool_dir = spool_dir
        self.share_exact = share_exact
        cfg = config if config is not None else getattr(getattr(kv_backend, "model", None), "config", None)
        self.src_pairing = kv_backend.rope.pairing
        self.pool_pairing = RopeSpec.from_config(cfg, engine="sglang").pairing if cfg is not None else self.src_pairing
        self.last_plan: Optional[WindowPlan] = None

    @classmethod
    def launch(cls, model_path: str, kv_backend: Any, *, page_size: int = 16, spool_dir: Optional[str] = None,
               stats_path: Optional[str] = None, config: Any = None, share_exact: bool = True,
               **engine_kwargs: Any) -> "SGLangBackend":
        """Start an SGLang Engine with the windowkit linker. Needs a CUDA GPU and sglang with its dependencies;
        raises UnsupportedModelError otherwise (nothing is started). The Engine's schedulers run in other
        processes, so plans' KV always travel as files: ``spool_dir`` (default: a new temporary directory)."""
        if not torch.cuda.is_available():
            raise UnsupportedModelError("SGLangBackend.launch needs a CUDA GPU; on a CPU use "
                                        "SGLangBackend.launch_cpu (Llama-family models, see docs/backends.md)")
        try:
            import sglang  # optional heavy dependency: only a launched engine needs it
        except ImportError as e:
            raise UnsupportedModelError(f"SGLangBackend needs sglang (pip install sglang==0.5.23): {e}") from None
        engine = sglang.Engine(model_path=model_path, page_size=page_size,
                               enable_unified_cache_external_linker=True,
                               unified_cache_external_linker_backend="dynamic",
                               unified_cache_external_linker_config=linker_config(kv_backend.fingerprint(), stats_path),
                               **engine_kwargs)
        if spool_dir is None:  # an in-process ("mem:") handle is never found by a scheduler process
            spool_dir = tempfile.mkdtemp(prefix="windowkit-spool-")
        return cls(engine, kv_backend, page_size=page_size, spool_dir=spool_dir, config=config,
                   share_exact=share_exact)

    @classmethod
    def launch_cpu(cls, model_path: str, kv_backend: Any, *, page_size: int = 16, spool_dir: Optional[str] = None,
                   stats_path: Optional[str] = None, log_path: Optional[str] = None, config: Any = None,
                   share_exact: bool = True, device: str = "cpu", **engine_kwargs: Any) -> "SGLangBackend":
        """Start a real SGLang Engine on this CPU (``cpu_engine.CPUEngine``: a child process with SGLang's CPU
        engine, ``torch_native`` attention, fp32, the sgl_kernel stand-in) with the windowkit linker; raises
        ``cpu_engine.EngineStartError`` with SGLang's reason when it cannot start. ``shutdown()`` stops it.
        ``device="cuda"``: the same hosted Engine on one GPU with SGLang's own kernels (scripts/gpu_check.sh)."""
        engine = CPUEngine.start(model_path, linker=linker_config(kv_backend.fingerprint(), stats_path),
                                 log_path=log_path, page_size=page_size, device=device, **engine_kwargs)
        if spool_dir is None:
            spool_dir = tempfile.mkdtemp(prefix="windowkit-spool-")
        return cls(engine, kv_backend, page_size=page_size, spool_dir=spool_dir, config=config,
                   share_exact=share_exact)

    # ------------------------------------------------------------------ the Backend protocol (KV side)
    needs_past = True  # the KV side (kv_backend) reads the past

    @property
    def reads_attention(self) -> bool:
        """The query's attention is read on ``kv_backend`` (where every KV the Window forms is computed), so the
        Window's question-aware repair (``Window.focus(query)``) runs as on that backend, before the plan is sent
        (``TextReaderAgent`` does so each step). SGLang's own attention is never read back."""
        return bool(self.kv_backend.reads_attention)

    @property
    def layout(self):
        return self.kv_backend.layout

    @property
    def rope(self):
        return self.kv_backend.rope

    @property
    def stats(self):
        return self.kv_backend.stats

    @property
    def n_axes(self) -> int:
        return self.kv_backend.n_axes

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_backend.dtype

    @property
    def device(self) -> torch.device:
        return self.kv_backend.device

    def fingerprint(self) -> str:
        return self.kv_backend.fingerprint()

    def positions(self, chunk: Chunk, start: int) -> tuple[torch.Tensor, int]:
        return self.kv_backend.positions(chunk, start)

    def span(self, chunk: Chunk) -> int:
        return self.kv_backend.span(chunk)

    def forget(self, chunk: Chunk) -> None:
        self.kv_backend.forget(chunk)

    def make_cache(self, past: Optional[ChunkKV]) -> Any:
        return self.kv_backend.make_cache(past)

    def check_kv(self, kv: ChunkKV) -> None:
        self.kv_backend.check_kv(kv)

    def forward(self, chunks: Sequence[Chunk], start: int, past: Optional[ChunkKV] = None) -> ForwardResult:
        """KV-producing forward (encode, conditioned forward): on ``kv_backend`` (SGLang returns no KV)."""
        return self.kv_backend.forward(chunks, start, past)

    def encode(self, chunk: Chunk) -> ChunkKV:
        return self.forward([chunk], 0).kv

    @property
    def supports_recompute(self) -> bool:
        return bool(self.kv_backend.supports_recompute)

    def recompute(self, past: Optional[ChunkKV], chunks: Sequence[Chunk], starts: Sequence[int],
                  offsets: Sequence[torch.Tensor], **kw: Any):
        """Selective recompute (survivor repair, the Window's deferred step): on ``kv_backend``, like ``forward``."""
        return self.kv_backend.recompute(past, chunks, starts, offsets, **kw)

    def query_attention(self, past: ChunkKV, query: Chunk, start: int, rows: int = 1, lookahead: int = 0,
                        return_kv: bool = False) -> Any:
        """The query's attention over ``past``, read on ``kv_backend`` (UnsupportedModelError where it reads none)."""
        return self.kv_backend.query_attention(past, query, start, rows=rows, lookahead=lookahead, return_kv=return_kv)

    # ------------------------------------------------------------------ serving through SGLang
    def request(self, window: Any, query_ids: Sequence[int], *, sampling_params: Optional[dict] = None,
                **generate_kwargs: Any) -> tuple[WindowPlan, dict]:
        """The plan for ``window`` and the ``Engine.generate`` keyword arguments of ``window + query``."""
        kv = window.window_kv()
        if kv is None:
            raise ChunkError("the window is empty: send the query to the engine directly")
        mode: SegMode = "exact" if getattr(window, "mode", "") == "exact" else "approx"
        plan, kwargs = plan_request(kv, window_token_ids(window), [int(t) for t in query_ids],
                                    page_size=self.page_size, fingerprint=self.fingerprint(), mode=mode,
                                    spool_dir=self.spool_dir, src_pairing=self.src_pairing,
                                    pool_pairing=self.pool_pairing, share_exact=self.share_exact,
                                    sampling_params=sampling_params)
        kwargs.update(generate_kwargs)
        ex = self.stats.extra
        ex["sglang_plans"] = ex.get("sglang_plans", 0) + 1
        ex["sglang_planned_tokens"] = ex.get("sglang_planned_tokens", 0) + plan.num_tokens
        ex["sglang_prefill_tokens"] = ex.get("sglang_prefill_tokens", 0) + len(kwargs["input_ids"]) - plan.num_tokens
        self.last_plan = plan
        return plan, kwargs

    def serve(self, window: Any, query_ids: Sequence[int], *, sampling_params: Optional[dict] = None,
              **generate_kwargs: Any) -> Any:
        """Run ``window + query`` on the engine with the window restored from windowkit KV; returns the
        engine's output. Whether the plan applied is counted by the linker (its ``stats_path``)."""
        _, kwargs = self.request(window, query_ids, sampling_params=sampling_params, **generate_kwargs)
        return self.engine.generate(**kwargs)

    def shutdown(self) -> None:
        shut = getattr(self.engine, "shutdown", None)
        if shut is not None:
            shut()


__all__ = ["SGLangBackend", "plan_request", "linker_config", "window_token_ids"]
