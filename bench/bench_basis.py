"""Shared patch basis vs per-item SVD patch on held-out (A, B) pairs (the Kamera paper, "Kamera: Unified
Position-Invariant Multimodal KV Cache for Training-Free Reuse": section 4, "The shape of the lost term
dictates a feature patch", and App. C.2).

    PYTHONPATH=. .venv/bin/python bench/bench_basis.py --json bench/results/basis.json

Per model: random-token pairs (A, B); the deficit Δ = R(-δ)KV(B|A) − KV(B|∅) of each. A SharedPatchBasis
(rank = slot width, so every rank m is its top-m prefix) is built from the TRAIN pairs' deficit rows; on
HELD-OUT pairs, at equal rank m, we compare next-token KL to re-prefill (query after [A, B]) and eta vs
blind reuse of:
  item      the item's own top-m SVD patch (patch_from_deficit)
  shared    coefficients on the pooled basis (SharedPatchBasis.encode, rank m)
  shared_pf the same, basis fed from the train items' rank-32 patches (observe_patch) instead of Δ rows
  shared_eq the pooled basis at equal bytes to `item` (rank m·(S+F)/S, capped at the basis size)
  random    coefficients on a random orthonormal m-dim basis (control: what any m-dim subspace recovers)
  blind     no patch
plus the deficit energy each recovers (1 − ‖Δ−Δ̂‖²/‖Δ‖², pooled) and bytes per patch. MLA's k_pe slot uses
rank max(1, m//4) in every arm (patch_from_deficit's default). Random-weight models need not share
directions the way trained ones do; the numbers are what they are.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import windowkit as wk
from windowkit.backends.tiny import build
from windowkit.kv import concat, deficit, eta, kl_divergence, place
from windowkit.kv.basis import SharedPatchBasis
from windowkit.kv.patch import Patch, as_matrix, patch_from_deficit


def _pairs(be, n: int, la: int, lb: int, lq: int, seed: int):
    V = be.vocab_size
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = wk.Chunk.text(torch.randint(10, V, (la,), generator=g))
        b = wk.Chunk.text(torch.randint(10, V, (lb,), generator=g))
        q = wk.Chunk.text(torch.randint(10, V, (lq,), generator=g))
        ka = be.forward([a], 0).kv
        cond = be.forward([b], la, past=ka).kv
        canon = be.encode(b)
        ref = be.forward([q], la + lb, past=concat([ka, cond])).logits
        out.append(dict(q=q, ka=ka, canon=canon, d=deficit(cond, canon, la, be.rope), ref=ref))
    return out


def _energy(p: Patch | None, d) -> tuple[float, float]:
    """(residual energy, total energy) of Δ − Δ̂ over all layer-slots."""
    res = tot = 0.0
    for l, pair in enumerate(d.layers):
        for s in (0, 1):
            x = as_matrix(pair[s])
            f = None if p is None else p.factors.get((l, s))
            xh = 0 if f is None else f[0].float() @ f[1].float()
            res += float(((x - xh) ** 2).sum())
            tot += float((x ** 2).sum())
    return res, tot


def _random_patch(d, m: int, rope_m: int, g: torch.Generator) -> Patch:
    lay = d.layout
    f = {}
    for l, pair in enumerate(d.layers):
        for s in (0, 1):
            x = as_matrix(pair[s])
            w = rope_m if (lay.family == "mla" and s == lay.rope_slot) else m
            w = min(w, x.shape[1])
            q = torch.linalg.qr(torch.randn(x.shape[1], w, generator=g))[0]
            f[(l, s)] = (x @ q, q.T.contiguous())
    return Patch(f, lay, d.num_tokens, m, rope_m)


def run_model(name: str, ranks, n_train: int, n_test: int, la: int, lb: int, lq: int, seed: int) -> dict:
    t0 = time.time()
    be = wk.HFBackend(build(name), verify=False)
    lay = be.layout
    widths = [h * d for h, d in lay.slot_shapes]
    F = max(widths)
    train = _pairs(be, n_train, la, lb, lq, seed)
    test = _pairs(be, n_test, la, lb, lq, seed + 1)
    basis = SharedPatchBasis(lay, F)
    for it in train:
        basis.observe(it["d"])
    basis_pf = SharedPatchBasis(lay, F)
    for it in train:
        basis_pf.observe_patch(patch_from_deficit(it["d"], 32))
    g = torch.Generator().manual_seed(seed + 7)
    blind = []
    for it in test:
        kv = place(it["canon"], la, be.rope)
        blind.append(kl_divergence(it["ref"], be.forward([it["q"]], la + lb, past=concat([it["ka"], kv])).logits))
    kl_blind = sum(blind) / len(blind)
    rows = []
    for m in ranks:
        rope_m = max(1, m // 4) if lay.family == "mla" else m
        m_eq = min(F, round(m * (lb + F) / lb))
        arms = {
            "item": lambda d: patch_from_deficit(d, m),
            "shared": lambda d: basis.encode(d, m, register=False),
            "shared_pf": lambda d: basis_pf.encode(d, m, register=False),
            "shared_eq": lambda d: basis.encode(d, m_eq, register=False),
            "random": lambda d: _random_patch(d, m, rope_m, g),
        }
        row = {"rank": m, "rank_equal_bytes": m_eq}
        for arm, make in arms.items():
            kls, res, tot, nbytes = [], 0.0, 0.0, 0
            for it in test:
                p = make(it["d"])
                kv = place(it["canon"], la, be.rope, p)
                logits = be.forward([it["q"]], la + lb, past=concat([it["ka"], kv])).logits
                kls.append(kl_divergence(it["ref"], logits))
                r, t = _energy(p, it["d"])
                res, tot = res + r, tot + t
                nbytes = SharedPatchBasis.coefficient_bytes(p) if arm.startswith("shared") or arm == "random" \
                    else p.nbytes
            kl = sum(kls) / len(kls)
            etas = sorted(eta(b, k) for b, k in zip(blind, kls))
            row[arm] = {"kl": kl, "eta": eta(kl_blind, kl), "eta_median": etas[len(etas) // 2],
                        "energy": 1.0 - res / max(tot, 1e-30), "bytes": nbytes}
        rows.append(row)
    kv_bytes = test[0]["canon"].nbytes
    return {"model": name, "layout": lay.describe(), "A_tokens": la, "B_tokens": lb, "query_tokens": lq,
            "n_train": n_train, "n_test": n_test, "kl_blind": kl_blind, "chunk_kv_bytes": kv_bytes,
            "basis_bytes": basis.basis_bytes(), "basis_rows_seen": basis.rows_seen,
            "basis_bytes_amortized_over_test": basis.basis_bytes() / n_test, "rows": rows,
            "seconds": time.time() - t0}


def table(results: list[dict]) -> str:
    out = ["| model | m | KL item | KL shared | KL shared (patch-fed) | KL shared @ equal bytes | KL random basis "
           "| KL blind | η item | η shared | energy item | energy shared | energy random | bytes item "
           "| bytes shared (coeff.) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r["rows"]:
            i, s, pf, eq, rnd = (row[k] for k in ("item", "shared", "shared_pf", "shared_eq", "random"))
            out.append(f"| {r['model']} | {row['rank']} | {i['kl']:.2e} | {s['kl']:.2e} | {pf['kl']:.2e} | "
                       f"{eq['kl']:.2e} (m={row['rank_equal_bytes']}) | {rnd['kl']:.2e} | {r['kl_blind']:.2e} | "
                       f"{i['eta']:.3f} | {s['eta']:.3f} | {i['energy']:.3f} | {s['energy']:.3f} | "
                       f"{rnd['energy']:.3f} | {i['bytes']:,} | {s['bytes']:,} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--models", default="tiny-llama,tiny-qwen2,tiny-deepseek-v3")
    ap.add_argument("--ranks", default="4,8,16,32")
    ap.add_argument("--train", type=int, default=64)
    ap.add_argument("--test", type=int, default=16)
    ap.add_argument("--a-tokens", type=int, default=32)
    ap.add_argument("--b-tokens", type=int, default=48)
    ap.add_argument("--q-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ranks = [int(x) for x in args.ranks.split(",")]
    results = [run_model(n, ranks, args.train, args.test, args.a_tokens, args.b_tokens, args.q_tokens, args.seed)
               for n in args.models.split(",")]
    print(table(results))
    for r in results:
        print(f"{r['model']}: basis {r['basis_bytes']:,} B (amortized over {r['n_test']} test patches: "
              f"{r['basis_bytes_amortized_over_test']:,.0f} B), chunk KV {r['chunk_kv_bytes']:,} B, {r['seconds']:.1f} s")
    if args.json_path:
        out = {"config": vars(args), "torch": torch.__version__, "platform": platform.platform(), "results": results}
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
