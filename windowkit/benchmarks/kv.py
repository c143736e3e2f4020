"""KV operator benchmark: reuse (relocate + rank-m patch) against re-prefill, forming cost, break-even, bandwidth.

    PYTHONPATH=. .venv/bin/python bench/bench_kv.py --quick --json bench/results/kv_quick.json
    windowkit bench kv --quick --json bench/results/kv_quick.json          # same thing through the CLI

    from windowkit.benchmarks.kv import run
    result = run(quick=True, json_path=None)   # dict: {"env": ..., "config": ..., "rows": [one per length]}

Model: a random-weight Qwen2 decoder shaped like Qwen2.5-0.5B's text decoder (hidden 896, 24 layers,
14 query heads, 2 KV heads, head_dim 64, MLP 4864, rope_theta 1e6, tied embeddings). The vocabulary is
cut to 8192 (from 151936) to save memory; it only changes the embedding/LM-head cost, which is small
next to the decoder at these lengths. Qwen2.5-VL's text decoder is this same architecture with M-RoPE;
for a text segment placed after a text context the M-RoPE axes all move together, so the relocation is
the same 1-D rotation measured here.

For each segment length L (context C = L tokens before it, a 16-token query after it):
  prefill   re-prefill of the segment after the context: ``backend.forward([seg], C, past=ctx_kv)``
            (this is also the conditioned forward KV(B|A) the first admission pays anyway)
  reuse     ``windowkit.kv.place(canon, C, spec, patch)``: relocate + patch apply over all layers
  blind     ``place(canon, C, spec)``: relocation only
  encode    canonical KV(B|∅): the segment alone at position 0 (one forward)
  svd_*     ``form_patch(cond, canon, C, spec, rank, method=...)`` for "exact" and "randomized"
  forming extra = encode + svd (the conditioned forward is the first admission's prefill, see
            docs/design "Where the cost goes"), in units of one prefill
  break-even = forming extra / (prefill - reuse) reuses; ``paper_style`` also charges the conditioned forward
  bandwidth = bytes moved by reuse (read canonical KV + patch, write the placed KV) per second, as a
            fraction of ``Tensor.copy_`` moving the same number of bytes in the same run
  fidelity = next-token KL(re-prefill || reuse) of the query after [context, segment], blind and patched,
            and the relative KV reconstruction error against the conditioned KV

Ops that are compared are timed round-robin (prefill/encode; copy/reuse/...), so a disturbance on a shared
machine hits both sides of a ratio alike; medians are reported, and the fastest sample as "best-of".

``experimental_fused_place`` and ``experimental_batched_place`` below are labelled EXPERIMENTS (not the
production operator, which lives in ``windowkit.kv``): R(δ)K + U(R(δ)Vᵀ) and V + UVᵀ written into
preallocated outputs, per layer or over all layers at once. They are here to measure how much of the
reuse time is avoidable overhead. Results and how to read them: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import transformers
from tqdm.auto import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM

import windowkit
from windowkit.backends.hf import HFBackend
from windowkit.chunk import Chunk
from windowkit.kv import apply_patch, concat, form_patch, kl_divergence, place
from windowkit.kv.layout import ChunkKV
from windowkit.kv.patch import reconstruction_error

QUERY_TOKENS = 16
FULL_LENGTHS = (256, 512, 1024, 2048)
QUICK_LENGTHS = (256, 512, 1024)
QUICK_LAYERS = 8
QUICK_BUDGET_S = 270.0  # --quick must finish in under five minutes, imports and model build included

# Qwen2.5-0.5B text decoder shape (vocab reduced, see module doc); "tiny" is for the smoke test only.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(vocab_size=8192, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


# ---------------------------------------------------------------------- small helpers
def _resolve_dtype(dtype: Optional[str], device: str) -> str:
    """'auto': bf16 on CUDA; fp32 on CPU (a CPU without bf16 units runs bf16 GEMMs several times slower,
    which would inflate the reuse/prefill ratio for a reason that has nothing to do with windowkit)."""
    if dtype in (None, "auto"):
        return "bf16" if str(device).startswith("cuda") else "fp32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return dtype


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Interleaved:
    times: dict[str, list[float]]
    first: dict[str, Any]


def _interleave(ops: dict[str, Callable[[], Any]], n: int, device: torch.device, warmup: int = 1,
                keep_first: bool = False) -> _Interleaved:
    """Time ``n`` rounds of every op, round-robin (op1, op2, ..., op1, op2, ...): a disturbance on a shared
    machine then hits every op alike and their ratios stay meaningful. ``warmup`` untimed rounds first.
    With ``keep_first`` the result of each op's first timed call is kept (the forwards' KV)."""
    for _ in range(warmup):
        for fn in ops.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in ops}
    first: dict[str, Any] = {}
    for i in range(max(1, n)):
        for k, fn in ops.items():
            _sync(device)
            t0 = time.perf_counter()
            r = fn()
            _sync(device)
            times[k].append(time.perf_counter() - t0)
            if keep_first and i == 0:
                first[k] = r
            del r
    return _Interleaved(times, first)


def _finite(x: Any) -> Any:
    """JSON-safe: non-finite floats become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _env(device: torch.device, dtype: str) -> dict[str, Any]:
    env = {
        "torch": torch.__version__, "transformers": transformers.__version__, "windowkit": windowkit.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(), "device": str(device), "dtype": dtype,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def build_model(preset: str = "qwen2.5-0.5b", n_layers: Optional[int] = None, dtype: str = "fp32",
                device: str = "cpu", seed: int = 0) -> Any:
    """Random-weight Qwen2ForCausalLM of the given preset shape (seeded), in eval mode."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    kw = dict(PRESETS[preset])
    if n_layers is not None:
        kw["num_hidden_layers"] = int(n_layers)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**kw))
    return model.to(device=device, dtype=_DTYPES[dtype]).eval()


# ---------------------------------------------------------------------- the EXPERIMENT: fused reuse
def experimental_fused_place(canon, delta: int, spec, patch, out=None, scratch: Optional[torch.Tensor] = None):
    """EXPERIMENT, not the production operator: R(δ)·(KV + U Vᵀ) in one pass per layer and slot.

    Uses R(δ)(K + U Vᵀ) = R(δ)K + U·(R(δ)Vᵀ): the rotation is applied to the m x H·D factor instead of
    the S x H·D update, the rotated keys are written straight into ``out`` (a preallocated ChunkKV, e.g.
    a slice of the window's cache), and the rank-m update is one batched GEMM per slot accumulated in
    place (``baddbmm_``). fp32 math; for bf16/fp16 KV a per-layer fp32 scratch is rounded once.
    Supports GQA, half pairing, a uniform integer delta and a patch on every layer; raises
    NotImplementedError otherwise.
    """
    lay = canon.layout
    if lay.family != "gqa" or spec.pairing != "half" or not isinstance(delta, int):
        raise NotImplementedError("experimental fused path: GQA, half pairing, integer delta only")
    if patch is None or any((l, s) not in patch.factors for l in range(lay.num_layers) for s in (0, 1)):
        raise NotImplementedError("experimental fused path: needs a patch on every layer and slot")
    dev = canon.device
    n = spec.n_freq
    ang = (float(delta) * spec.inv_freq.double()).float().to(dev)
    c, s = ang.cos(), ang.sin()
    if out is None:
        out = ChunkKV([(torch.empty_like(a), torch.empty_like(b)) for a, b in canon.layers], lay)
    f32 = canon.dtype == torch.float32
    if not f32 and scratch is None:
        h, S, d = canon.layers[0][0].shape
        scratch = torch.empty(h, S, d, dtype=torch.float32, device=dev)
    for l, ((k, v), (ok, ov)) in enumerate(zip(canon.layers, out.layers)):
        h, S, d = k.shape
        us, vt = patch.factors[(l, 0)]
        m = us.shape[1]
        t = ok if f32 else scratch
        t1, t2 = t[..., :n], t[..., n:]
        torch.mul(k[..., :n], c, out=t1)
        t1.addcmul_(k[..., n:], s, value=-1.0)
        torch.mul(k[..., n:], c, out=t2)
        t2.addcmul_(k[..., :n], s)
        vf = vt.float().view(m, h, d)  # rotate the factor rows: m·H·D work instead of S·H·D
        v1, v2 = vf[..., :n], vf[..., n:]
        vr = torch.cat([v1 * c - v2 * s, v2 * c + v1 * s], -1).permute(1, 0, 2)  # [H, m, D]
        t.baddbmm_(us.float().expand(h, S, m), vr)
        if not f32:
            ok.copy_(t)
        us, vt = patch.factors[(l, 1)]
        hv, _, dv = v.shape
        vv = vt.float().view(m, hv, dv).permute(1, 0, 2)
        if f32:
            torch.baddbmm(v, us.expand(hv, S, m), vv, out=ov)
        else:
            scratch.copy_(v)
            scratch.baddbmm_(us.float().expand(hv, S, m), vv)
            ov.copy_(scratch)
    return out


def stack_for_batched(canon, patch) -> dict[str, torch.Tensor]:
    """EXPERIMENT helper: all layers' KV and factors as stacked tensors (the store layout the batched
    experiment assumes: one [NL, H, S, D] tensor per slot instead of NL separate ones). Not timed."""
    if canon.layout.family != "gqa" or patch is None:
        raise NotImplementedError("experimental batched path: GQA with a patch only")
    nl = canon.layout.num_layers
    if any((l, s) not in patch.factors for l in range(nl) for s in (0, 1)):
        raise NotImplementedError("experimental batched path: needs a patch on every layer and slot")
    return {
        "k": torch.stack([a for a, _ in canon.layers]), "v": torch.stack([b for _, b in canon.layers]),
        "us_k": torch.stack([patch.factors[(l, 0)][0] for l in range(nl)]).float(),
        "vt_k": torch.stack([patch.factors[(l, 0)][1] for l in range(nl)]).float(),
        "us_v": torch.stack([patch.factors[(l, 1)][0] for l in range(nl)]).float(),
        "vt_v": torch.stack([patch.factors[(l, 1)][1] for l in range(nl)]).float(),
    }


def experimental_batched_place(st: dict[str, torch.Tensor], delta: int, spec, out_k: torch.Tensor,
                               out_v: torch.Tensor) -> None:
    """EXPERIMENT, not the production operator: the fused reuse over ALL layers at once.

    Same math as ``experimental_fused_place`` on stacked tensors (``stack_for_batched``): one rotation
    over [NL, H, S, D] and one batched GEMM per slot, so the op count no longer grows with the layer
    count. Writes into ``out_k`` / ``out_v`` ([NL, H, S, D]); fp32 math (bf16/fp16 KV via fp32 temporaries,
    rounded once).
    """
    k, v = st["k"], st["v"]
    if spec.pairing != "half" or not isinstance(delta, int):
        raise NotImplementedError("experimental batched path: half pairing, integer delta only")
    f32 = k.dtype == torch.float32
    nl, h, S, d = k.shape
    n = spec.n_freq
    ang = (float(delta) * spec.inv_freq.double()).float().to(k.device)
    c, s = ang.cos(), ang.sin()
    tk = out_k if f32 else torch.empty(k.shape, dtype=torch.float32, device=k.device)
    torch.mul(k[..., :n], c, out=tk[..., :n])
    tk[..., :n].addcmul_(k[..., n:], s, value=-1.0)
    torch.mul(k[..., n:], c, out=tk[..., n:])
    tk[..., n:].addcmul_(k[..., :n], s)
    m = st["us_k"].shape[-1]
    vf = st["vt_k"].view(nl, m, h, d)
    vr = torch.cat([vf[..., :n] * c - vf[..., n:] * s, vf[..., n:] * c + vf[..., :n] * s], -1)
    us = st["us_k"][:, None].expand(nl, h, S, m).reshape(nl * h, S, m)
    tk.view(nl * h, S, d).baddbmm_(us, vr.permute(0, 2, 1, 3).reshape(nl * h, m, d))
    if not f32:
        out_k.copy_(tk)
    hv, dv = v.shape[1], v.shape[3]
    us = st["us_v"][:, None].expand(nl, hv, S, m).reshape(nl * hv, S, m)
    vv = st["vt_v"].view(nl, m, hv, dv).permute(0, 2, 1, 3).reshape(nl * hv, m, dv)
    if f32:
        torch.baddbmm(v.view(nl * hv, S, dv), us, vv, out=out_v.view(nl * hv, S, dv))
    else:
        out_v.view(nl * hv, S, dv).copy_(torch.baddbmm(v.view(nl * hv, S, dv).float(), us, vv))


# ---------------------------------------------------------------------- one segment length
def _rel_err(a, b) -> float:
    return reconstruction_error(a, b)


def _bench_length(be, L: int, C: int, rank: int, reps: dict[str, int], device: torch.device,
                  gen: torch.Generator, bar: Optional[Any]) -> dict[str, Any]:
    def step(name: str) -> None:
        if bar is not None:
            bar.set_postfix_str(f"L={L} {name}")

    med = statistics.median
    V = be.vocab_size
    ctx = Chunk.text(torch.randint(10, V, (C,), generator=gen), id=f"bench-ctx-{C}")
    seg = Chunk.text(torch.randint(10, V, (L,), generator=gen), id=f"bench-seg-{L}")
    query = Chunk.text(torch.randint(10, V, (QUERY_TOKENS,), generator=gen), id=f"bench-q-{L}")
    spec = be.rope
    row: dict[str, Any] = {"L": L, "context": C, "query_tokens": QUERY_TOKENS, "rank": rank}

    step("context")
    ctx_kv = be.forward([ctx], 0).kv  # also warms the model up

    # (a) re-prefill of the segment after the context, interleaved with (c) the canonical encode so that a
    # disturbance on a shared machine hits both alike. The first prefill is the conditioned KV(B|A) (the
    # first admission's prefill), the first encode the canonical KV(B|∅); every call is a timed sample.
    step("prefill + encode")
    fw = _interleave({"prefill": lambda: be.forward([seg], C, past=ctx_kv).kv, "encode": lambda: be.encode(seg)},
                     reps["prefill"], device, warmup=0, keep_first=True)
    cond, canon = fw.first["prefill"], fw.first["encode"]
    ts_pre, ts_enc = fw.times["prefill"], fw.times["encode"]
    t_prefill, t_enc = med(ts_pre), med(ts_enc)
    row["prefill_ms"], row["prefill_min_ms"] = 1e3 * t_prefill, 1e3 * min(ts_pre)
    row["prefill_ms_all"] = [1e3 * t for t in ts_pre]
    row["encode_ms"], row["encode_min_ms"] = 1e3 * t_enc, 1e3 * min(ts_enc)

    # (c) form_patch with exact and randomized SVD (includes the deficit R(-δ)·cond - canon)
    step("form_patch")
    fp = _interleave({m: (lambda m=m: form_patch(cond, canon, C, spec, rank=rank, method=m))
                      for m in ("exact", "randomized")}, reps["svd"], device, warmup=0, keep_first=True)
    patches = fp.first
    for m in ("exact", "randomized"):
        row[f"svd_{m}_ms"] = 1e3 * med(fp.times[m])
    patch = patches["exact"]

    # (f) bytes
    kv_bytes, patch_bytes = canon.nbytes, patch.nbytes
    moved = 2 * kv_bytes + patch_bytes  # reuse reads the canonical KV and the patch, writes the placed KV
    row["kv_bytes"], row["patch_bytes"] = kv_bytes, patch_bytes
    row["patch_pct_of_kv"] = 100.0 * patch_bytes / kv_bytes
    row["bytes_moved"] = moved

    # (b, e) reuse and its parts, interleaved with a plain copy of the same bytes
    step("reuse + copy")
    src = torch.empty(moved // 2, dtype=torch.uint8, device=device).fill_(1)  # copying moved/2 bytes reads
    dst = torch.empty_like(src)  # moved/2 and writes moved/2: the same bytes reuse moves
    f32 = {k: (u.float(), v.float()) for k, (u, v) in patch.factors.items()}
    bufs = {k: torch.empty(u.shape[0], v.shape[1], device=device) for k, (u, v) in f32.items()}
    ops: dict[str, Callable[[], Any]] = {
        "copy": lambda: dst.copy_(src),
        "reuse": lambda: place(canon, C, spec, patch),  # the production operator
        "blind": lambda: place(canon, C, spec),  # relocation only
        "apply_only": lambda: apply_patch(canon, patch),
        # compute floor of the rank-m update on this machine: the GEMMs alone, fp32, preallocated outputs
        "gemm": lambda: [torch.mm(u, v, out=bufs[k]) for k, (u, v) in f32.items()],
    }
    # EXPERIMENTS (see the functions' docstrings): fused per layer, and batched over all layers
    notes = {}
    out = ChunkKV([(torch.empty_like(a), torch.empty_like(b)) for a, b in canon.layers], canon.layout)
    h, S, d = canon.layers[0][0].shape
    scratch = None if canon.dtype == torch.float32 else torch.empty(h, S, d, device=device)
    try:
        experimental_fused_place(canon, C, spec, patch, out, scratch)
        ops["fused"] = lambda: experimental_fused_place(canon, C, spec, patch, out, scratch)
    except NotImplementedError as e:
        notes["fused"] = str(e)
    st = ok = ov = None
    try:
        st = stack_for_batched(canon, patch)  # a store-layout change: done once, outside the timing
        ok, ov = torch.empty_like(st["k"]), torch.empty_like(st["v"])
        experimental_batched_place(st, C, spec, ok, ov)
        ops["batched"] = lambda: experimental_batched_place(st, C, spec, ok, ov)
    except NotImplementedError as e:
        notes["batched"] = str(e)
    tm = _interleave(ops, reps["reuse"], device, warmup=2).times
    t = {k: med(v) for k, v in tm.items()}
    best = {k: min(v) for k, v in tm.items()}

    row["reuse_ms"], row["reuse_min_ms"] = 1e3 * t["reuse"], 1e3 * best["reuse"]
    row["reuse_blind_ms"], row["reuse_blind_min_ms"] = 1e3 * t["blind"], 1e3 * best["blind"]
    row["apply_patch_only_ms"], row["apply_patch_only_min_ms"] = 1e3 * t["apply_only"], 1e3 * best["apply_only"]
    row["speedup"] = t_prefill / t["reuse"]
    row["speedup_best"] = min(ts_pre) / best["reuse"]  # least disturbed samples on a shared machine
    row["speedup_blind"] = t_prefill / t["blind"]

    # (c, d) forming extra in prefills and break-even reuses
    saved = t_prefill - t["reuse"]
    for m in ("exact", "randomized"):
        extra = t_enc + row[f"svd_{m}_ms"] / 1e3
        row[f"forming_extra_{m}_prefills"] = extra / t_prefill
        row[f"break_even_{m}"] = extra / saved if saved > 0 else float("inf")
        # as if forming also paid its own conditioned forward (how the paper counts it)
        row[f"break_even_{m}_paper_style"] = (extra + t_prefill) / saved if saved > 0 else float("inf")

    # (e) bandwidth
    row["copy_ms"], row["copy_min_ms"] = 1e3 * t["copy"], 1e3 * best["copy"]
    row["copy_gbps"] = moved / t["copy"] / 1e9
    row["reuse_gbps"] = moved / t["reuse"] / 1e9
    row["apply_bw_fraction"] = t["copy"] / t["reuse"]
    row["apply_bw_fraction_best"] = best["copy"] / best["reuse"]
    rs = canon.layout.rope_slot  # blind reuse reads and writes the rotated slot only (the other is shared)
    blind_moved = 2 * sum(pair[rs].numel() * pair[rs].element_size() for pair in canon.layers)
    row["blind_bw_fraction"] = (t["copy"] * blind_moved / moved) / t["blind"]
    row["gemm_floor_ms"], row["gemm_floor_min_ms"] = 1e3 * t["gemm"], 1e3 * best["gemm"]
    row["bw_fraction_ceiling_gemm"] = t["copy"] / t["gemm"]

    ref = place(canon, C, spec, patch)
    if "fused" in t:
        row["experimental_fused_ms"], row["experimental_fused_min_ms"] = 1e3 * t["fused"], 1e3 * best["fused"]
        row["experimental_fused_speedup_vs_reuse"] = t["reuse"] / t["fused"]
        row["experimental_fused_bw_fraction"] = t["copy"] / t["fused"]
        row["experimental_fused_bw_fraction_best"] = best["copy"] / best["fused"]
        row["experimental_fused_rel_diff"] = _rel_err(out, ref)
    else:
        row["experimental_fused_ms"], row["experimental_fused_note"] = None, notes["fused"]
    if "batched" in t:
        row["experimental_batched_ms"] = 1e3 * t["batched"]
        row["experimental_batched_min_ms"] = 1e3 * best["batched"]
        row["experimental_batched_speedup_vs_reuse"] = t["reuse"] / t["batched"]
        row["experimental_batched_rel_diff"] = _rel_err(
            ChunkKV([(ok[l], ov[l]) for l in range(canon.layout.num_layers)], canon.layout), ref)
    else:
        row["experimental_batched_ms"], row["experimental_batched_note"] = None, notes["batched"]
    del src, dst, f32, bufs, out, scratch, st, ok, ov, ref

    # (g) fidelity sanity: query after [context, segment] with the segment re-prefilled / blind / patched
    step("fidelity")
    start_q = C + L
    ref_logits = be.forward([query], start_q, past=concat([ctx_kv, cond])).logits
    blind_kv = place(canon, C, spec)
    row["kl_blind"] = kl_divergence(ref_logits, be.forward([query], start_q, past=concat([ctx_kv, blind_kv])).logits)
    row["recon_err_blind"] = _rel_err(blind_kv, cond)
    for m, p in patches.items():
        kv = place(canon, C, spec, p)
        row[f"kl_patch_{m}"] = kl_divergence(ref_logits, be.forward([query], start_q, past=concat([ctx_kv, kv])).logits)
        row[f"recon_err_patch_{m}"] = _rel_err(kv, cond)
    for c in (ctx, seg, query):  # drop cached embeddings (forget takes a Chunk; older versions took its id)
        try:
            be.forget(c)
        except (AttributeError, TypeError):
            be.forget(c.id)
    return {k: _finite(v) for k, v in row.items()}


# ---------------------------------------------------------------------- driver
def run(quick: bool = False, json_path: Optional[str] = None, lengths: Optional[Sequence[int]] = None, rank: int = 32,
        dtype: Optional[str] = "auto", device: str = "cpu", progress: bool = True, *, preset: str = "qwen2.5-0.5b",
        n_layers: Optional[int] = None, context: Optional[int] = None, repeats: Optional[int] = None,
        seed: int = 0, budget_s: Optional[float] = None, threads: Optional[int] = None) -> dict[str, Any]:
    """Run the KV benchmark; returns (and optionally writes as JSON) ``{"env", "config", "rows", "notes"}``.

    quick:    8 decoder layers and L in (256, 512, 1024) (a few minutes on 2 CPU cores); full: 24 layers and
              L in (256, 512, 1024, 2048) (meant for a GPU machine or a patient user).
    dtype:    "auto" (bf16 on CUDA, fp32 on CPU), "bf16", "fp32" or "fp16".
    context:  context tokens before the segment; default C = L.
    repeats:  timed repeats of the forwards (median reported); the cheap ops take 10x as many.
    budget_s: skip a length whose projected time would overrun this wall-clock budget (default: 270 s
              with ``quick``, none otherwise); skipped lengths are listed in the result.
    threads:  torch intra-op threads for the run (default: leave torch's setting). On a shared machine one
              thread is far steadier: a 2-thread op stalls whenever another process holds one of the cores.
    """
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        return _run(quick, json_path, lengths, rank, dtype, device, progress, preset, n_layers, context, repeats,
                    seed, budget_s)
    finally:
        torch.set_num_threads(old_threads)


def _run(quick, json_path, lengths, rank, dtype, device, progress, preset, n_layers, context, repeats, seed,
         budget_s) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    dev = torch.device(device)
    dtype = _resolve_dtype(dtype, device)
    if lengths is None:
        lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    lengths = [int(x) for x in lengths]
    if n_layers is None and quick and preset == "qwen2.5-0.5b":
        n_layers = QUICK_LAYERS
    if budget_s is None and quick:
        budget_s = QUICK_BUDGET_S
    r = int(repeats) if repeats is not None else (3 if quick else 5)
    reps = {"prefill": r, "svd": r, "reuse": max(10, 15 * r)}  # the encode is interleaved with the prefill

    model = build_model(preset, n_layers, dtype, device, seed)
    be = HFBackend(model)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    config = {
        "preset": preset, "quick": quick, "lengths": lengths, "context": context or "L", "rank": rank,
        "repeats": reps, "seed": seed, "query_tokens": QUERY_TOKENS,
        "model": {"architecture": "Qwen2ForCausalLM (random weights)", "hidden_size": cfg.hidden_size,
                  "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
                  "num_key_value_heads": cfg.num_key_value_heads,
                  "head_dim": cfg.hidden_size // cfg.num_attention_heads,
                  "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
                  "params_millions": round(n_params / 1e6, 1), "attn_implementation": cfg._attn_implementation,
                  "layout": be.layout.describe()},
    }
    notes = [
        "random weights; Qwen2.5-0.5B text-decoder shape" + (" (vocab 8192 instead of 151936 to save memory)"
                                                             if preset == "qwen2.5-0.5b" else ""),
        "Qwen2.5-VL's text decoder is the same architecture with M-RoPE; a text segment after text context "
        "moves all M-RoPE axes together, i.e. the same 1-D rotation",
        "times are medians of one run on this machine; ratios are comparable within the run, not across machines",
        "forming extra = canonical encode + form_patch (the conditioned forward is the first admission's prefill)",
        "apply_bw_fraction = copy time / reuse time for the same bytes moved (2*KV + patch)",
    ]
    if quick and preset == "qwen2.5-0.5b":
        notes.append(f"--quick: {QUICK_LAYERS} of 24 layers (every per-layer cost scales with the layer count)")

    gen = torch.Generator().manual_seed(seed + 1)
    rows = []
    bar = None
    if progress:
        bar = tqdm(lengths, desc="bench kv", unit="len", file=sys.stderr)
    skipped = []
    last = None  # (L, seconds) of the previous length, to project the next one
    for L in lengths:
        if budget_s is not None and last is not None:
            projected = last[1] * (L / last[0]) ** 1.2  # prefill grows a bit faster than linearly in L
            if time.perf_counter() - t_start + projected > budget_s:
                skipped.append(L)
                if bar is not None:
                    bar.update(1)
                continue
        t_len = time.perf_counter()
        rows.append(_bench_length(be, L, int(context) if context else L, rank, reps, dev, gen, bar))
        last = (L, time.perf_counter() - t_len)
        if bar is not None:
            bar.update(1)
    if skipped:
        notes.append(f"skipped L={skipped}: projected to exceed the {budget_s:.0f} s time budget on this machine")
    if bar is not None:
        bar.close()

    env = _env(dev, dtype)
    env["loadavg_1m_at_start"] = load_start
    result = {"benchmark": "kv", "env": env, "config": config, "rows": rows, "skipped_lengths": skipped,
              "notes": notes,
              "total_seconds": time.perf_counter() - t_start}
    if json_path:
        d = os.path.dirname(os.path.abspath(json_path))
        os.makedirs(d, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, allow_nan=False)
    return result


def _fmt(x: Any, spec: str) -> str:
    if x is None:
        return "n/a"
    return format(x, spec)


def format_table(result: dict[str, Any]) -> str:
    """Markdown summary of a ``run`` result (one row per segment length)."""
    head = ("| L | prefill ms | reuse ms | speedup (best-of) | blind ms | encode ms | SVD exact / rand ms | "
            "forming extra (prefills) exact / rand | break-even exact / rand | apply BW % of copy | "
            "fused exp. ms (BW %) | patch % of KV | KL blind / patch |")
    sep = "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"
    lines = [head, sep]
    for r in result["rows"]:
        fused = ("n/a" if r.get("experimental_fused_ms") is None else
                 f"{r['experimental_fused_ms']:.2f} ({100 * r['experimental_fused_bw_fraction']:.0f}%)")
        lines.append(
            f"| {r['L']} | {r['prefill_ms']:.0f} | {r['reuse_ms']:.2f} "
            f"| {r['speedup']:.0f}x ({r['speedup_best']:.0f}x) "
            f"| {r['reuse_blind_ms']:.2f} "
            f"| {r['encode_ms']:.0f} | {r['svd_exact_ms']:.0f} / {r['svd_randomized_ms']:.0f} "
            f"| {r['forming_extra_exact_prefills']:.2f} / {r['forming_extra_randomized_prefills']:.2f} "
            f"| {_fmt(r['break_even_exact'], '.2f')} / {_fmt(r['break_even_randomized'], '.2f')} "
            f"| {100 * r['apply_bw_fraction']:.1f}% | {fused} | {r['patch_pct_of_kv']:.1f}% "
            f"| {r['kl_blind']:.1e} / {r['kl_patch_exact']:.1e} |")
    lines.append("")
    lines.append("Where the reuse time goes (best-of ms, i.e. the least disturbed sample; % = copy time / op time "
                 "for the bytes reuse moves):")
    lines.append("")
    lines.append("| L | copy | reuse = place() | apply_patch only | relocate only (blind) | fused exp. | "
                 "batched exp. | rank-m GEMMs alone | patch bytes |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        cp = r["copy_min_ms"]

        def cell(key: str) -> str:
            v = r.get(key)
            return "n/a" if v is None else f"{v:.2f} ({100 * cp / v:.1f}%)"

        lines.append(f"| {r['L']} | {cp:.3f} | {cell('reuse_min_ms')} | {cell('apply_patch_only_min_ms')} "
                     f"| {cell('reuse_blind_min_ms')} | {cell('experimental_fused_min_ms')} "
                     f"| {cell('experimental_batched_min_ms')} "
                     f"| {cell('gemm_floor_min_ms')} | {r['patch_bytes'] / 2**20:.2f} MiB |")
    e, c = result["env"], result["config"]["model"]
    lines.append("")
    lines.append(f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']}q/"
                 f"{c['num_key_value_heads']}kv heads x {c['head_dim']}, rank {result['config']['rank']}, "
                 f"{e['dtype']} on {e['device']} ({e['cpu']}, {e['torch_threads']} threads), torch {e['torch']}, "
                 f"transformers {e['transformers']}; total {result['total_seconds']:.0f} s")
    return "\n".join(lines)


def _parse_lengths(s: str) -> list[int]:
    return [int(x) for x in s.replace(",", " ").split()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="windowkit bench kv",
                                description="KV operator benchmark: reuse (relocate + rank-m patch) vs re-prefill")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_LAYERS} layers, L in {QUICK_LENGTHS} (minutes on CPU)")
    p.add_argument("--json", dest="json_path", default=None, help="write the result as JSON to this path")
    p.add_argument("--lengths", type=_parse_lengths, default=None, help="segment lengths, e.g. 256,512")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES], help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 24; 8 with --quick)")
    p.add_argument("--context", type=int, default=None, help="context tokens before the segment (default L)")
    p.add_argument("--repeats", type=int, default=None, help="timed forward repeats (default 3 quick, 5 full)")
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=list(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"skip lengths projected to overrun this many seconds "
                        f"(default {QUICK_BUDGET_S:.0f} with --quick)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    result = run(quick=a.quick, json_path=a.json_path, lengths=a.lengths, rank=a.rank, dtype=a.dtype,
                 device=a.device, progress=not a.no_progress, preset=a.preset, n_layers=a.layers,
                 context=a.context, repeats=a.repeats, seed=a.seed, budget_s=a.budget,
                 threads=a.threads)
    print(format_table(result))
    if a.json_path:
        print(f"\nwrote {a.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
