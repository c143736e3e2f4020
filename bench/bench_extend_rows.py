"""SGLang's torch_native extend attention against the plugin's row-only version, one layer, one thread.

    PYTHONPATH=. .venv/bin/python bench/bench_extend_rows.py     # ~10 s: writes bench/results/extend_rows.{json,md}

One SmolLM2-135M layer's shapes (9 query heads, 3 KV heads, head dim 64) on three requests of the
k = 8 x 256 sliding window (bench/bench_sglang_ttft.py): a radix hit of the 32-token system prompt (2,078 new
tokens), a plain prefill (2,110 new tokens), and a restored window (2,080 tokens from a windowkit plan, 30 new).
Both functions run interleaved on the same tensors; medians of 9 calls; outputs compared.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sglang.srt.layers.attention.torch_native_backend as native  # noqa: E402

from windowkit.backends.sglang import extend_rows  # noqa: E402

ORIGINAL = native.TorchNativeAttnBackend._run_sdpa_forward_extend


class _Self:  # the original reads self only for sliding-window masks
    _make_sliding_window_mask = native.TorchNativeAttnBackend._make_sliding_window_mask


def request(prefix: int, new: int, heads: int = 9, kv_heads: int = 3, dim: int = 64):
    g = torch.Generator().manual_seed(prefix + new)
    L = prefix + new
    k, v = torch.randn(L + 16, kv_heads, dim, generator=g), torch.randn(L + 16, kv_heads, dim, generator=g)
    req_to_token = torch.zeros(2, L + 16, dtype=torch.long)
    req_to_token[1, :L] = torch.randperm(L + 16, generator=g)[:L]
    q = torch.randn(new, heads, dim, generator=g)
    return q, (k, v, req_to_token, torch.tensor([1]), torch.tensor([L]), torch.tensor([prefix]), torch.tensor([new]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=str(ROOT / "bench/results/extend_rows.json"))
    ap.add_argument("--md", default=str(ROOT / "bench/results/extend_rows.md"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    kw = dict(scaling=0.125, enable_gqa=True, causal=True)
    rows = []
    for name, p, n in (("radix hit (system prompt)", 32, 2078), ("plain prefill", 0, 2110),
                       ("restored window (windowkit plan)", 2080, 30)):
        q, args = request(p, n)
        ts, th = [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            want = ORIGINAL(_Self(), q, torch.empty_like(q), *args, **kw)
            ts.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = extend_rows.extend_rows_attention(ORIGINAL, _Self(), q, torch.empty_like(q), *args, **kw)
            th.append(time.perf_counter() - t)
        rows.append(dict(request=name, prefix=p, new=n, sglang_ms=1e3 * statistics.median(ts),
                         rows_ms=1e3 * statistics.median(th), max_abs_diff=float((got - want).abs().max())))
    Path(a.json).write_text(json.dumps({"threads": 1, "reps": a.reps, "rows": rows}, indent=1))
    md = ["One layer's extend attention (9 query heads, 3 KV heads, dim 64), 1 thread, median of "
          f"{a.reps} interleaved calls (`bench/bench_extend_rows.py`).", "",
          "| request | cached prefix | new tokens | SGLang's method ms | row-only ms | ratio | max abs diff |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['request']} | {r['prefix']} | {r['new']} | {r['sglang_ms']:.1f} | {r['rows_ms']:.1f} | "
           f"{r['sglang_ms'] / r['rows_ms']:.2f}x | {r['max_abs_diff']:.1e} |" for r in rows]
    Path(a.md).write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
