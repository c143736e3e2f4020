"""Cost of authentication: a shared-tier get of a 1 MB entry, unkeyed (sha256 envelope) vs keyed (HMAC-SHA256).

    PYTHONPATH=. .venv/bin/python bench/bench_security.py          # bench/results/security.{json,md}
    PYTHONPATH=. .venv/bin/python bench/bench_security.py --quick  # fewer repeats

Starts its own loopback Mooncake Store (``LocalMooncake``). Both backends hold the same 1 MiB value (random
bytes, meta like a store entry's); each round times one get of each, in alternating order, so both see the
same machine load; the ratio is keyed / unkeyed of the medians over all rounds of this one run (and, more
robust to load that drifts during the run, the median of the per-round ratios). Rows:

  check only     ``unpack`` of the envelope in memory (the verification itself: sha256 vs HMAC-SHA256)
  mooncake get   ``MooncakeBackend.get`` on loopback (the Mooncake read + the check + the copy out)

Target (issue 21): keyed no slower than unkeyed, i.e. ratio <= 1 within noise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from windowkit.store.auth import EntryAuth
from windowkit.store.backend import pack, unpack
from windowkit.store.mooncake import LocalMooncake, MooncakeBackend

KEY = b"bench-key-0123456789abcdef0123456789"


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def row(name: str, t_plain: list[float], t_keyed: list[float]) -> dict:
    """Medians, their ratio, and the median of per-round ratios (robust to load drifting during the run)."""
    return {"row": name, "unkeyed_ms": median_ms(t_plain), "keyed_ms": median_ms(t_keyed),
            "ratio_keyed_over_unkeyed": median_ms(t_keyed) / median_ms(t_plain),
            "median_paired_ratio": statistics.median(k / p for k, p in zip(t_keyed, t_plain))}


def paired(a, b, rounds: int) -> tuple[list[float], list[float]]:
    """Times of ``a()`` and ``b()``, alternating which goes first each round."""
    ta, tb = [], []
    for i in range(rounds):
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return ta, tb


def run(rounds: int, size: int) -> dict:
    value = os.urandom(size)
    # the metadata ChunkStore writes with a canonical (ident, sizes, the caller's meta, the KV layout)
    meta = {"format": "windowkit-shared/1", "kind": "c", "key": "k" * 32, "ctx": "", "model_fingerprint": "f" * 64,
            "nbytes": size, "meta": {"tokens": 64, "chunk_id": "frame-12"},
            "layout": '{"family": "qwen2", "num_layers": 28, "rope_slot": 0, "slot_shapes": [[4, 128], [4, 128]]}'}
    auth = EntryAuth(KEY)
    plain_blob = pack(value, meta)
    keyed_blob = pack(value, meta, auth=auth, namespace="bench", key="c/k/")
    t_plain, t_keyed = paired(lambda: unpack(plain_blob),
                              lambda: unpack(keyed_blob, auth=auth, namespace="bench", key="c/k/"), rounds)
    rows = [row("check only (unpack)", t_plain, t_keyed)]
    with LocalMooncake(segment_bytes=64 << 20) as mc:
        plain = MooncakeBackend(mc.config(timeout_s=30.0), namespace="bench")
        # the same Mooncake client under both: the only difference left is the envelope and its check
        keyed = MooncakeBackend(mc.config(timeout_s=30.0), namespace="bench", client=plain.client, auth_key=KEY)
        try:
            plain.put("c/k/", value, meta)
            keyed.put("c/k/", value, meta)
            assert plain.get("c/k/") == keyed.get("c/k/") == (value, meta)
            t_plain, t_keyed = paired(lambda: plain.get("c/k/"), lambda: keyed.get("c/k/"), rounds)
        finally:
            plain.clear()
            keyed.clear()
            keyed.close()  # its client is plain's (borrowed: left open), closed once below
            plain.close()
    rows.append(row("mooncake get (loopback)", t_plain, t_keyed))
    return {"bench": "security", "entry_bytes": size, "rounds": rounds, "rows": rows,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "command": "PYTHONPATH=. .venv/bin/python bench/bench_security.py"}


def markdown(res: dict) -> str:
    lines = [f"Shared-tier get of a {res['entry_bytes'] >> 20} MiB entry, median of {res['rounds']} paired rounds "
             "(one run; `bench/bench_security.py`).", "",
             "| path | unkeyed (sha256) ms | keyed (HMAC-SHA256) ms | keyed / unkeyed | median paired ratio |",
             "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['row']} | {r['unkeyed_ms']:.3f} | {r['keyed_ms']:.3f} | {r['ratio_keyed_over_unkeyed']:.3f} "
                     f"| {r['median_paired_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default="bench/results/security", help="path stem of the .json and .md results")
    args = ap.parse_args()
    res = run(args.rounds or (20 if args.quick else 400), 1 << 20)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
