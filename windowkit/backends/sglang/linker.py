"""WindowkitLinker: SGLang's ``UnifiedCacheLinker`` that restores a request's window from windowkit KV.

Loaded by SGLang's ``dynamic`` linker backend inside every scheduler process::

    python -m sglang.launch_server ... --page-size 16 \\
        --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic \\
        --unified-cache-external-linker-config '{"linker": "WindowkitLinker",
            "linker_module_path": "windowkit.backends.sglang.linker",
            "linker_extra_config": {"model_fingerprint": "...", "stats_path": "/tmp/wk_stats.json"}}'

How a request gets its window (SGLang 0.5.23, ``UnifiedCacheLinkerWrapper``):

1. The plugin hook (``plugin.py``) reads the request's plan from ``custom_params`` and registers it here
   (``REGISTRY``), by rid and by the chained page hashes of the plan's tokens under the plan's
   ``cache_salt`` (which it also sets on the request).
2. ``match`` -> ``lookup(rid, transfers)``: the KV transfer carries the page hashes of the prompt's
   device-uncached tail. The linker finds the plan (by rid, else by the first hash), locates the tail in
   the plan (the chained hashes give the absolute page offset) and answers every restorable length.
3. ``load_back`` -> ``load(rid, transfers)``: SGLang allocated ``device_indices`` (one slot per token of the
   restorable pages); the linker queues the plan's KV for those slots.
4. Batch start -> ``start_layer_wise_loading``: the writes run layer by layer through ``SGLangKVPool``
   (SGLang's own ``set_kv_buffer``) on the forward stream, and each layer is marked done, so attention of
   layer l (``get_key_buffer`` waits on ``layer_done_counter``) sees its KV. SGLang then prefills only the
   rest of the prompt and inserts the restored pages into its radix tree under the request's namespace.

Anything that cannot be applied is not restored: SGLang prefills those tokens itself (exact re-prefill)
and ``REGISTRY.stats`` counts the fallback with its reason. windowkit never offloads (``offload`` -> False).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from windowkit.backends.sglang import extend_rows
from windowkit.backends.sglang.plan import WindowPlan, page_hashes
from windowkit.backends.sglang.pool import SGLangKVPool
from windowkit.errors import KVShapeError, UnsupportedModelError

logger = logging.getLogger(__name__)


@dataclass
class LinkerStats:
    """What happened to the plans this scheduler saw (cumulative)."""

    plans: int = 0  # plans registered
    applied: int = 0  # requests whose window pages were restored
    pages_restored: int = 0
    tokens_restored: int = 0
    fallbacks: int = 0  # plans (or parts) SGLang prefilled instead: exact re-prefill
    reasons: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["reasons"] = dict(self.reasons)
        d["extend_rows"] = dict(extend_rows.COUNTS)  # this process's row-only extend attention (plugin option)
        return d


@dataclass
class _Entry:
    plan: WindowPlan
    hashes: list[str]  # chained page hashes of plan.token_ids under the request namespace
    rid: Optional[str] = None
    failed: Optional[str] = None  # fallback reason, once counted


class PlanRegistry:
    """Plans by rid and by page hash, per scheduler process (bounded: oldest plans drop first).

        REGISTRY.register(plan, rid="r1")         # what the plugin hook does
        REGISTRY.stats.fallbacks, REGISTRY.stats.reasons
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.by_rid: dict[str, _Entry] = {}
        self.by_hash: OrderedDict[str, tuple[_Entry, int]] = OrderedDict()
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # plan_id + namespace -> entry
        self.stats = LinkerStats()
        self.stats_path: Optional[str] = None
        self.lock = threading.Lock()

    def register(self, plan: WindowPlan, *, rid: Optional[str] = None, extra_key: Optional[str] = None,
                 prompt_ids: Optional[Sequence[int]] = None, cache_salt: Optional[str] = None) -> Optional[str]:
        """Index ``plan`` for a request; returns the fallback reason when it cannot apply (counted), else None.

        ``prompt_ids``: the request's prompt (must start with the plan's tokens); ``cache_salt``: the
        request's salt (must be the plan's)."""
        with self.lock:
            self.stats.plans += 1
        reason = plan.problem(page_size=plan.page_size)
        if reason is None and (cache_salt or None) != plan.cache_salt:
            reason = "salt_mismatch"
        if reason is None and prompt_ids is not None and (
                len(prompt_ids) < plan.num_tokens or list(map(int, prompt_ids[:plan.num_tokens])) != plan.token_ids):
            reason = "token_mismatch"
        if reason is not None:
            self.fallback(None, reason, plan.plan_id)
            return reason
        hashes = page_hashes(plan.token_ids, plan.page_size, extra_key=extra_key, cache_salt=plan.cache_salt)
        entry = _Entry(plan, hashes, rid)
        with self.lock:
            key = f"{plan.plan_id}|{extra_key}"
            old = self.entries.pop(key, None)
            if old is not None and old.rid and old.rid != rid:
                self.by_rid.pop(old.rid, None)
            self.entries[key] = entry
            if rid is not None:
                self.by_rid[rid] = entry
            for i, h in enumerate(hashes):
                self.by_hash[h] = (entry, i)
                self.by_hash.move_to_end(h)
            while len(self.entries) > self.capacity:
                _, dead = self.entries.popitem(last=False)
                if dead.rid is not None and self.by_rid.get(dead.rid) is dead:
                    del self.by_rid[dead.rid]
                for h in dead.hashes:
                    if self.by_hash.get(h, (None,))[0] is dead:
                        del self.by_hash[h]
        return None

    def find(self, rid: str, keys: Sequence[str]) -> tuple[Optional[_Entry], Optional[int]]:
        """The plan for this request and the page offset of ``keys[0]`` in it (None: keys not in the plan)."""
        with self.lock:
            entry = self.by_rid.get(rid)
            if entry is not None:  # the rid's own plan first: another plan may share its leading pages
                if keys and keys[0] in entry.hashes:
                    return entry, entry.hashes.index(keys[0])
                return entry, None
            hit = self.by_hash.get(keys[0]) if keys else None
            return hit if hit is not None else (None, None)

    def fallback(self, entry: Optional[_Entry], reason: str, plan_id: str = "") -> None:
        """Count one fallback (once per request and plan)."""
        if entry is not None:
            if entry.failed is not None:
                return
            entry.failed = reason
            plan_id = entry.plan.plan_id
        with self.lock:
            self.stats.fallbacks += 1
            self.stats.reasons[reason] += 1
        logger.info("windowkit plan %s not applied (%s): SGLang prefills it", plan_id, reason)
        self.dump()

    def applied(self, pages: int, tokens: int) -> None:
        with self.lock:
            self.stats.applied += 1
            self.stats.pages_restored += pages
            self.stats.tokens_restored += tokens
        self.dump()

    def forget(self, rid: str) -> None:
        with self.lock:
            self.by_rid.pop(rid, None)

    def dump(self) -> None:
        """Write the stats to ``stats_path`` (atomic rename); an I/O error is logged, never raised."""
        if not self.stats_path:
            return
        with self.lock:
            data = self.stats.as_dict()
        tmp = f"{self.stats_path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.stats_path)
        except OSError:
            logger.exception("windowkit linker: cannot write stats to %s", self.stats_path)

    def clear(self) -> None:
        with self.lock:
            self.by_rid.clear()
            self.by_hash.clear()
            self.entries.clear()
            self.stats = LinkerStats()


REGISTRY = PlanRegistry()


@dataclass
class _Load:
    entry: _Entry
    first_page: int  # page offset of the restored tail inside the plan
    loc: torch.Tensor  # device slot ids, one per token


class WindowkitLinker(UnifiedCacheLinker):
    """SGLang external cache linker whose "store" is windowkit's per-request window plans.

    Constructed by SGLang (``linker_factory.create_unified_cache_linker``) as
    ``WindowkitLinker(server_args, params, components=..., extra_config=..., forward_stream=...)``.
    ``extra_config``: ``model_fingerprint`` (plans for another model fall back), ``stats_path`` (JSON dump of
    ``REGISTRY.stats`` after every change), ``tp_rank`` / ``tp_size`` (default: the attention-TP group).
    """

    def __init__(self, server_args: Any, params: Any, *, components: Any = None,
                 extra_config: Optional[dict] = None, forward_stream: Any = None,
                 registry: Optional[PlanRegistry] = None):
        cfg = dict(extra_config or {})
        self.kv = params.token_to_kv_pool_allocator.get_kvcache()
        self.page_size = int(params.page_size)
        self.pools = {PoolName.KV: self.kv}
        self.forward_stream = forward_stream
        self.registry = registry if registry is not None else REGISTRY
        if cfg.get("stats_path"):
            self.registry.stats_path = str(cfg["stats_path"])
        self.fingerprint = cfg.get("model_fingerprint")
        self.tp_rank, self.tp_size = self._tp(params, cfg)
        # components other than the full KV (SWA, Mamba state) are not restorable from windowkit KV
        names = {getattr(c, "name", str(c)) for c in (components or ())}
        self.unsupported = sorted(n for n in names if n != "FULL")
        self.num_layers = int(self.kv.layer_num)
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self.pending: dict[str, _Load] = {}
        self._writers: dict[tuple, SGLangKVPool] = {}

    @staticmethod
    def _tp(params: Any, cfg: dict) -> tuple[int, int]:
        if "tp_rank" in cfg:
            return int(cfg["tp_rank"]), int(cfg.get("tp_size", 1))
        group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
        if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
        return 0, 1

    # ------------------------------------------------------------------ helpers
    def _writer(self, plan: WindowPlan) -> SGLangKVPool:
        key = (plan.layout, plan.src_pairing, plan.pool_pairing)
        w = self._writers.get(key)
        if w is None:
            w = SGLangKVPool(self.kv, plan.layout, tp_rank=self.tp_rank, tp_size=self.tp_size,
                             src_pairing=plan.src_pairing, pool_pairing=plan.pool_pairing)
            self._writers[key] = w
        return w

    def _check(self, entry: _Entry) -> Optional[str]:
        """Why this plan cannot be applied here (None: it can). Loads the payload once."""
        if self.unsupported:
            return "unsupported_pool"
        reason = entry.plan.problem(page_size=self.page_size, fingerprint=self.fingerprint)
        if reason is not None:
            return reason
        try:
            self._writer(entry.plan)
        except KVShapeError:
            return "layout_mismatch"
        except UnsupportedModelError:
            return "unsupported_pool"
        if not entry.plan.payload_present():
            return "kv_missing"
        try:
            entry.plan.kv()
        except KVShapeError:  # unreadable, or not the plan's shape
            return "layout_mismatch"
        return None

    def _restorable(self, rid: str, keys: Sequence[str]) -> tuple[Optional[_Entry], int, int]:
        """(entry, first page, pages) of the plan that matches ``keys``; pages 0 when nothing applies."""
        entry, first = self.registry.find(rid, keys)
        if entry is None:
            return None, 0, 0  # not a windowkit request
        if entry.failed is not None:
            return entry, 0, 0
        try:
            reason = self._check(entry)
        except Exception:  # never raise into SGLang's match path: the request is prefilled instead
            logger.exception("windowkit linker: checking plan %s failed", entry.plan.plan_id)
            reason = "bad_plan"
        if reason is None and first is None:
            reason = "hash_mismatch"  # the request is hashed differently (namespace, tokens, eagle bigrams...)
        if reason is not None:
            self.registry.fallback(entry, reason)
            return entry, 0, 0
        n = 0
        while n < len(keys) and first + n < len(entry.hashes) and entry.hashes[first + n] == keys[n]:
            n += 1
        return entry, first, n

    # ------------------------------------------------------------------ UnifiedCacheLinker
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys:
            return []
        _, _, n = self._restorable(rid, list(kv.keys))
        return list(range(1, n + 1))  # a plain KV pool: every page boundary of the run is restorable

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        keys = list(kv.keys)
        entry, first, n = self._restorable(rid, keys)
        if entry is None or n < len(keys):
            return False
        loc = kv.device_indices
        if loc.numel() != len(keys) * self.page_size:
            self.registry.fallback(entry, "page_size_mismatch")
            return False
        if rid in self.pending:  # SGLang queues one load per request; refuse a second one (it recomputes)
            logger.warning("windowkit load for rid=%s is already queued", rid)
            return False
        self.pending[rid] = _Load(entry, first, loc)
        return True

    def start_layer_wise_loading(self) -> int:
        if not self.pending:
            return -1
        todo, self.pending = self.pending, {}
        index = self.layer_done_counter.update_producer()
        try:
            jobs = []
            for load in todo.values():
                plan = load.entry.plan
                a = load.first_page * self.page_size
                kv = plan.kv().slice(a, a + load.loc.numel())
                jobs.append((self._writer(plan), kv, load.loc))
            with self._stream():
                for l in range(self.num_layers):
                    for writer, kv, loc in jobs:
                        writer.write(kv, loc, layers=[writer.start_layer + l])
                    # the writes are queued on the forward stream ahead of the forward: done in stream order
                    self.layer_done_counter.complete(index, l)
        except BaseException as e:  # the forward still runs; finish() reports it and SGLang aborts these requests
            for load in todo.values():
                self.registry.fallback(load.entry, "load_error")
            self.layer_done_counter.fail(index, e)
            logger.exception("windowkit layer-wise load failed")
            return index
        for rid, load in todo.items():
            self.registry.applied(load.loc.numel() // self.page_size, load.loc.numel())
            self.registry.forget(rid)
            if not load.entry.plan.kv_ref.startswith("mem:"):
                load.entry.plan._kv = None  # a later hit reloads the file; do not hold window KV in RAM
        return index

    def _stream(self):
        if self.forward_stream is not None and torch.cuda.is_available():
            return torch.cuda.stream(self.forward_stream)
        return contextlib.nullcontext()

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending.pop(rid, None) is not None

    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:
        return False  # windowkit's KV comes from windowkit; SGLang's own pages are never copied out

    def num_completed_offloads(self) -> int:
        return 0

    def pop_completed_offload(self) -> bool:
        return False

    def reset(self) -> None:
        self.pending.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()


__all__ = ["WindowkitLinker", "PlanRegistry", "LinkerStats", "REGISTRY"]
