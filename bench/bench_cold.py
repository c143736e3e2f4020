"""Cold tier: bytes, KV reconstruction error and next-token KL of compressed canonicals (issue 3, part 3).

    PYTHONPATH=. .venv/bin/python bench/bench_cold.py --json bench/results/cold.json

For each tiny model and trial: random text chunks A (antecedent, 64 tokens), B (the stored chunk, 128-256
tokens) and q (query, 8 tokens). ``KV(B|∅)`` goes into a ``ChunkStore`` with a cold tier, is compressed
(``store.compress``) and read back (``store.get_canonical``: the reconstruction). Both the exact and the cold
canonical are placed behind A with ``place(canon, len(A), rope)`` (blind reuse), q runs over that window,
and its next-token distribution is compared with

    re-prefill   HFBackend.forward over [A, B, q]      (ground truth)
    exact blind  the exact canonical placed the same way (what compression should not move away from)

``kl_cold_vs_exact`` isolates the compression; ``kl_ref_cold`` vs ``kl_ref_exact`` is what a user of blind
reuse sees. Bytes are the store's entry bytes (budget bytes) against the exact entry's.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch

import windowkit as wk
from windowkit.backends.tiny import build
from windowkit.kv import concat, kl_divergence, place
from windowkit.store import ChunkStore, ColdTierConfig
from windowkit.store.cold import compress_kv

RANKS = (4, 8, 16, 32)
MODELS = ("tiny-llama", "tiny-deepseek-v3")


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def run_model(name: str, trials: int, lengths: tuple[int, ...], a_len: int, q_len: int,
              protected: int, recent: int) -> list[dict]:
    be = wk.HFBackend(build(name))
    g = torch.Generator().manual_seed(0)
    cases = []
    for t in range(trials):
        n_b = lengths[t % len(lengths)]
        A, B, q = (wk.Chunk.text(torch.randint(10, be.vocab_size, (n,), generator=g), id=f"{c}{t}")
                   for c, n in (("a", a_len), ("b", n_b), ("q", q_len)))
        ref = be.forward([A, B, q], 0).logits
        kv_a, canon = be.encode(A), be.encode(B)
        exact_logits = be.forward([q], a_len + n_b, concat([kv_a, place(canon, a_len, be.rope)])).logits
        cases.append((A, B, q, n_b, ref, kv_a, canon, exact_logits))
    # baseline: the canonical only rounded to bf16 (no low rank), placed the same way
    bf16 = [kl_divergence(ex, be.forward([q], a_len + n_b, concat(
        [kv_a, place(canon.to(torch.bfloat16).to(torch.float32), a_len, be.rope)])).logits)
        for A, B, q, n_b, ref, kv_a, canon, ex in cases]
    rows = []
    for variant, rope in (("post-RoPE", None), ("pre-RoPE", be.rope)):
        for rank in RANKS:
            cfg = ColdTierConfig(rank=rank, protected_rows=protected, recent_rows=recent, rope=rope)
            acc = {k: [] for k in ("bytes", "exact_bytes", "rel_err", "kl_ref_exact", "kl_ref_cold",
                                   "kl_cold_vs_exact", "compress_ms", "get_ms", "slots_cold", "ratio_bf16")}
            for A, B, q, n_b, ref, kv_a, canon, exact_logits in cases:
                store = ChunkStore(model_fingerprint=be.fingerprint(), layout=be.layout, cold=cfg)
                store.put_canonical("b", canon)
                exact_bytes = store.nbytes
                t0 = time.perf_counter()
                store.compress("b")
                t1 = time.perf_counter()
                cold = store.get_canonical("b")
                t2 = time.perf_counter()
                meta = store.meta("b")
                logits = be.forward([q], a_len + n_b, concat([kv_a, place(cold, a_len, be.rope)])).logits
                acc["bytes"].append(store.nbytes)
                acc["exact_bytes"].append(exact_bytes)
                acc["rel_err"].append(meta.get("approx", 0.0))
                acc["slots_cold"].append(meta.get("cold", {}).get("slots_cold", 0))
                acc["kl_ref_exact"].append(kl_divergence(ref, exact_logits))
                acc["kl_ref_cold"].append(kl_divergence(ref, logits))
                acc["kl_cold_vs_exact"].append(kl_divergence(exact_logits, logits))
                acc["compress_ms"].append((t1 - t0) * 1e3)
                acc["get_ms"].append((t2 - t1) * 1e3)
                got16 = compress_kv(canon.to(torch.bfloat16), cfg)  # the same chunk stored from a bf16 model
                acc["ratio_bf16"].append(1.0 if got16 is None else got16[1]["exact_bytes"] / got16[1]["bytes"])
            row = {"model": name, "keys": variant, "rank": rank, "trials": len(cases),
                   "layout": be.layout.describe(), "kv_dtype": str(cases[0][6].dtype).replace("torch.", ""),
                   "factor_dtype": "bfloat16", "protected_rows": protected, "recent_rows": recent,
                   "tokens_B": list(lengths)}
            row.update({k: _mean(v) for k, v in acc.items()})
            row["ratio"] = row["exact_bytes"] / row["bytes"]
            row["kl_ref_cold_max"] = max(acc["kl_ref_cold"])
            row["kl_cold_vs_exact_max"] = max(acc["kl_cold_vs_exact"])
            row["kl_bf16_round_vs_exact"] = _mean(bf16)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 192, 256])
    ap.add_argument("--a-len", type=int, default=64)
    ap.add_argument("--q-len", type=int, default=8)
    ap.add_argument("--protected", type=int, default=4)
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for m in args.models:
        rows += run_model(m, args.trials, tuple(args.lengths), args.a_len, args.q_len, args.protected, args.recent)
    print("| model | keys | rank | cold slots | bytes / exact (fp32 KV) | ratio | ratio if KV were bf16 "
          "| rel. KV error | KL(ref‖exact blind) | KL(ref‖cold blind) | KL(exact‖cold) mean / max |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['keys']} | {r['rank']} | {r['slots_cold']:.0f}/8 | "
              f"{r['bytes']:,.0f} / {r['exact_bytes']:,.0f} | {r['ratio']:.2f}x | {r['ratio_bf16']:.2f}x | "
              f"{r['rel_err']:.3f} | "
              f"{r['kl_ref_exact']:.2e} | {r['kl_ref_cold']:.2e} | "
              f"{r['kl_cold_vs_exact']:.2e} / {r['kl_cold_vs_exact_max']:.2e} |")
    for m in args.models:
        r = next(r for r in rows if r["model"] == m)
        print(f"{m}: KL(exact‖exact rounded to bf16, no low rank) = {r['kl_bf16_round_vs_exact']:.2e}")
    if args.json_path:
        out = {"env": {"torch": torch.__version__, "threads": 2, "cpu": platform.processor() or platform.machine()},
               "args": vars(args), "rows": rows}
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
