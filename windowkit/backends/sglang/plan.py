"""A window plan: which page-aligned token ranges of an SGLang prompt come from windowkit KV.

A plan travels with one SGLang request as JSON (``sampling_params["custom_params"]["windowkit_plan"]``)
and is applied inside the scheduler by ``WindowkitLinker``. It names the prompt tokens the KV covers,
the segments (chunks) that make up that KV and whether each one is exact or approximate (blind or
patched), the KV payload (a safetensors file, or an in-process handle), the model fingerprint and the
layout. Nothing here imports sglang at module load.

    plan = WindowPlan.build(kv, prompt_ids, page_size=16, fingerprint=fp, layout=backend.layout,
                            segments=[Segment(0, 64, "exact", "sys"), Segment(64, 192, "approx", "doc")])
    params = {"custom_params": {"windowkit_plan": plan.to_json()}}
    engine.generate(input_ids=prompt_ids, sampling_params=params, rid=plan.plan_id,
                    cache_salt=plan.cache_salt)

Rules (``WindowPlan.problem`` returns the first one broken, as a fallback reason):

* every segment boundary is a multiple of the page size and the segments tile ``[0, num_tokens)``
  (SGLang restores whole pages, and its radix tree stores them by chained page hash);
* the KV holds exactly ``num_tokens`` tokens, in the plan's layout, for the plan's model;
* the request's prompt starts with the plan's tokens, under the plan's ``cache_salt``.

``cache_salt``: a plan with any approximate segment gets a salt derived from the plan (model, tokens,
segments, a digest of the KV), so SGLang's radix tree keeps its pages in a namespace of their own and an
exact-prefix request never reads approximate KV (nor the other way round). An all-exact plan has no salt:
its pages are interchangeable with SGLang's own prefill and may be shared.
"""
from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from windowkit.errors import KVShapeError, WindowkitError
from windowkit.kv.layout import ChunkKV, KVLayout

PLAN_KEY = "windowkit_plan"  # key of the plan in SGLang's sampling_params["custom_params"]
PLAN_VERSION = 1
SegMode = Literal["exact", "approx"]

# Fallback reasons (the keys of LinkerStats.reasons)
REASONS = ("bad_plan", "misaligned", "page_size_mismatch", "token_mismatch", "layout_mismatch",
           "fingerprint_mismatch", "kv_missing", "salt_mismatch", "hash_mismatch", "unsupported_pool",
           "load_error")

# In-process KV payloads ("mem:<id>"), for a scheduler that runs in this process (tests, offline tools)
MEMORY_KV: dict[str, ChunkKV] = {}


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, stop)`` of the plan, one window entry's KV: exact (prefill / exact relocation)
    or approx (blind relocation, rank-m patch)."""

    start: int
    stop: int
    mode: SegMode = "approx"
    chunk: str = ""

    def to_json(self) -> dict:
        return {"start": self.start, "stop": self.stop, "mode": self.mode, "chunk": self.chunk}


def layout_to_json(layout: KVLayout) -> dict:
    return {"family": layout.family, "num_layers": layout.num_layers,
            "slot_shapes": [list(s) for s in layout.slot_shapes], "rope_slot": layout.rope_slot}


def layout_from_json(d: dict) -> KVLayout:
    (h0, d0), (h1, d1) = d["slot_shapes"]
    return KVLayout(d["family"], int(d["num_layers"]), ((int(h0), int(d0)), (int(h1), int(d1))), int(d["rope_slot"]))


def kv_digest(kv: ChunkKV) -> str:
    """sha256 of the KV bytes (layer by layer, both slots): the KV's identity inside a cache_salt."""
    h = hashlib.sha256()
    for pair in kv.layers:
        for t in pair:
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def derive_cache_salt(fingerprint: str, token_ids: Sequence[int], segments: Sequence[Segment],
                      digest: str) -> Optional[str]:
    """None for an all-exact plan (its pages may be shared with SGLang's own prefill); otherwise a salt
    that changes with anything that changes the approximate KV."""
    if all(s.mode == "exact" for s in segments):
        return None
    h = hashlib.sha256(json.dumps({"v": PLAN_VERSION, "model": fingerprint, "tokens": list(map(int, token_ids)),
                                   "segments": [s.to_json() for s in segments], "kv": digest},
                                  sort_keys=True).encode())
    return "windowkit-" + h.hexdigest()[:32]


def page_hashes(token_ids: Sequence[int], page_size: int, *, extra_key: Optional[str] = None,
                cache_salt: Optional[str] = None) -> list[str]:
    """SGLang's chained storage hashes of the full pages of ``token_ids`` from the sequence head, seeded by
    the request namespace (``extra_key``, ``cache_salt``): the keys the linker is asked about."""
    from sglang.srt.mem_cache.radix_cache import RadixKey  # optional heavy dependency: sglang's own hash
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n = len(token_ids) // page_size * page_size
    if n == 0:
        return []
    key = RadixKey(array("q", [int(t) for t in token_ids[:n]]), extra_key=extra_key, cache_salt=cache_salt)
    return list(get_storage_hash_str(key, None, page_size=page_size))


@dataclass
class WindowPlan:
    """One request's window plan (JSON-safe descriptor; the KV itself is behind ``kv_ref``)."""

    plan_id: str
    token_ids: list[int]
    segments: list[Segment]
    kv_ref: str  # "mem:<id>" (MEMORY_KV) or a safetensors path
    layout: KVLayout
    fingerprint: str
    page_size: int
    cache_salt: Optional[str] = None
    src_pairing: str = "half"  # rope-slot pair layout of the payload (transformers: "half")
    pool_pairing: str = "half"  # SGLang's pair layout for this model
    version: int = PLAN_VERSION
    _kv: Optional[ChunkKV] = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pages(self) -> int:
        return self.num_tokens // self.page_size

    @property
    def approximate(self) -> bool:
        return any(s.mode != "exact" for s in self.segments)

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, kv: ChunkKV, token_ids: Sequence[int], *, page_size: int, fingerprint: str,
              segments: Optional[Sequence[Segment]] = None, mode: SegMode = "approx",
              spool_dir: Optional[str] = None, src_pairing: str = "half", pool_pairing: str = "half",
              share_exact: bool = True) -> "WindowPlan":
        """A plan for the first ``len(kv)`` prompt tokens, cut down to whole pages (the cut-off tail and
        everything after it is prefilled by SGLang, conditioned on the restored pages).

        ``segments`` default: one segment of ``mode`` over the kept tokens. A segment boundary inside the
        kept range that is not page aligned is kept as given: the linker refuses such a plan
        (``misaligned``), so nothing approximate is ever restored at the wrong granularity.
        ``spool_dir``: write the KV there as safetensors (the scheduler runs in another process);
        default: keep it in this process (``MEMORY_KV``). ``share_exact=False`` salts exact plans too.
        """
        token_ids = [int(t) for t in token_ids]
        if kv.num_tokens != len(token_ids):
            raise KVShapeError(f"KV holds {kv.num_tokens} tokens, the plan names {len(token_ids)}")
        if page_size < 1:
            raise WindowkitError(f"page_size must be >= 1, got {page_size}")
        keep = len(token_ids) // page_size * page_size
        segs = list(segments) if segments is not None else [Segment(0, len(token_ids), mode, "window")]
        segs = [Segment(s.start, min(s.stop, keep), s.mode, s.chunk) for s in segs if s.start < keep]
        kv = kv.slice(0, keep) if keep != kv.num_tokens else kv
        token_ids = token_ids[:keep]
        digest = kv_digest(kv)
        salt = derive_cache_salt(fingerprint, token_ids, segs, digest)
        if salt is None and not share_exact:
            salt = derive_cache_salt(fingerprint, token_ids, [Segment(0, keep, "approx", "exact")], digest)
        plan_id = "wk-" + hashlib.sha256(f"{fingerprint}|{salt}|{digest}|{token_ids}".encode()).hexdigest()[:24]
        if spool_dir is None:
            ref = "mem:" + plan_id
            MEMORY_KV[plan_id] = kv
        else:
            os.makedirs(spool_dir, exist_ok=True)
            ref = os.path.join(os.path.abspath(spool_dir), plan_id + ".safetensors")
            save_kv(kv, ref)
        return cls(plan_id, token_ids, segs, ref, kv.layout, fingerprint, int(page_size), salt,
                   src_pairing, pool_pairing)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        return {"version": self.version, "plan_id": self.plan_id, "token_ids": list(self.token_ids),
                "segments": [s.to_json() for s in self.segments], "kv_ref": self.kv_ref,
                "layout": layout_to_json(self.layout), "fingerprint": self.fingerprint, "page_size": self.page_size,
                "cache_salt": self.cache_salt, "src_pairing": self.src_pairing, "pool_pairing": self.pool_pairing}

    @classmethod
    def from_json(cls, d: Any) -> "WindowPlan":
        """Parse a plan; malformed input raises WindowkitError (the linker counts it as ``bad_plan``)."""
        try:
            if isinstance(d, str):
                d = json.loads(d)
            if int(d.get("version", 0)) != PLAN_VERSION:
                raise WindowkitError(f"plan version {d.get('version')} != {PLAN_VERSION}")
            segs = [Segment(int(s["start"]), int(s["stop"]), s.get("mode", "approx"), str(s.get("chunk", "")))
                    for s in d["segments"]]
            return cls(str(d["plan_id"]), [int(t) for t in d["token_ids"]], segs, str(d["kv_ref"]),
                       layout_from_json(d["layout"]), str(d["fingerprint"]), int(d["page_size"]),
                       d.get("cache_salt") or None, str(d.get("src_pairing", "half")),
                       str(d.get("pool_pairing", "half")))
        except WindowkitError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise WindowkitError(f"malformed windowkit plan: {type(e).__name__}: {e}") from None

    # ------------------------------------------------------------------ checks
    def problem(self, *, page_size: int, layout: Optional[KVLayout] = None,
                fingerprint: Optional[str] = None) -> Optional[str]:
        """The fallback reason that stops this plan from being applied, or None. Does not load the KV."""
        if self.page_size != page_size:
            return "page_size_mismatch"
        if not self.segments or self.num_tokens == 0:
            return "bad_plan"
        if any(s.mode not in ("exact", "approx") for s in self.segments):
            return "bad_plan"
        edge = 0
        for s in self.segments:
            if s.start != edge or s.stop <= s.start:
                return "bad_plan"  # segments must tile [0, num_tokens)
            edge = s.stop
        if edge != self.num_tokens:
            return "token_mismatch"
        if any(s.start % page_size or s.stop % page_size for s in self.segments):
            return "misaligned"
        if layout is not None and layout != self.layout:
            return "layout_mismatch"
        if fingerprint is not None and fingerprint != self.fingerprint:
            return "fingerprint_mismatch"
        if self.approximate and not self.cache_salt:
            return "salt_mismatch"  # approximate KV must never land in the shared namespace
        return None

    def payload_present(self) -> bool:
        """Whether the KV payload still exists (in-process handle or file)."""
        if self._kv is not None:
            return True
        if self.kv_ref.startswith("mem:"):
            return self.kv_ref[4:] in MEMORY_KV
        return os.path.isfile(self.kv_ref)

    def kv(self, device: Any = None) -> ChunkKV:
        """The payload (cached after the first load). Raises KVShapeError when it is missing or does not
        match the plan (the linker counts ``kv_missing`` / ``token_mismatch`` / ``layout_mismatch``)."""
        if self._kv is None:
            if self.kv_ref.startswith("mem:"):
                kv = MEMORY_KV.get(self.kv_ref[4:])
                if kv is None:
                    raise KVShapeError(f"in-process KV {self.kv_ref!r} is gone")
            else:
                kv = load_kv(self.kv_ref, self.layout)
            if kv.layout != self.layout:
                raise KVShapeError(f"plan KV layout {kv.layout.describe()} != plan's {self.layout.describe()}")
            if kv.num_tokens != self.num_tokens:
                raise KVShapeError(f"plan KV holds {kv.num_tokens} tokens, the plan names {self.num_tokens}")
            self._kv = kv
        return self._kv if device is None else self._kv.to(device=device)


# ---------------------------------------------------------------------- payload files (safetensors, no pickle)
def save_kv(kv: ChunkKV, path: str) -> None:
    """Write ``kv`` as one safetensors file (atomic rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: v.detach().cpu().contiguous() for k, v in kv.to_tensors().items()}, tmp,
              metadata={"windowkit": "plan-kv", "layout": json.dumps(layout_to_json(kv.layout))})
    os.replace(tmp, path)


def load_kv(path: str, layout: KVLayout) -> ChunkKV:
    if not os.path.exists(path):
        raise KVShapeError(f"plan KV file {path} does not exist")
    try:
        tensors = load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise KVShapeError(f"plan KV file {path} is unreadable: {e}") from None
    return ChunkKV.from_tensors(tensors, layout)


__all__ = ["WindowPlan", "Segment", "PLAN_KEY", "REASONS", "MEMORY_KV", "derive_cache_salt", "kv_digest",
           "page_hashes", "save_kv", "load_kv", "layout_to_json", "layout_from_json"]
