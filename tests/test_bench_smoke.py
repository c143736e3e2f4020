"""Smoke test of the KV benchmark (windowkit.benchmarks.kv) at a minimal size.

Checks the JSON it writes has every field and that the numbers are finite and positive. It makes NO
timing assertions: this machine is shared and noisy, ratios are reported by the benchmark, not tested.
"""
from __future__ import annotations

import json
import math

from windowkit.benchmarks.kv import format_table, run

POSITIVE = [
    "prefill_ms", "encode_ms", "svd_exact_ms", "svd_randomized_ms", "reuse_ms", "reuse_blind_ms", "speedup",
    "speedup_blind", "forming_extra_exact_prefills", "forming_extra_randomized_prefills", "kv_bytes",
    "patch_bytes", "patch_pct_of_kv", "bytes_moved", "copy_ms", "copy_gbps", "reuse_gbps", "apply_bw_fraction",
    "blind_bw_fraction", "gemm_floor_ms", "bw_fraction_ceiling_gemm", "experimental_fused_ms",
    "experimental_fused_speedup_vs_reuse", "experimental_fused_bw_fraction", "experimental_batched_ms",
    "speedup_best", "apply_bw_fraction_best",
]
NON_NEGATIVE = ["kl_blind", "kl_patch_exact", "kl_patch_randomized", "recon_err_blind", "recon_err_patch_exact",
                "recon_err_patch_randomized", "experimental_fused_rel_diff", "experimental_batched_rel_diff"]
# None only when re-prefill is not slower than reuse (cannot happen in practice, but it is not asserted)
MAYBE_NONE = ["break_even_exact", "break_even_randomized", "break_even_exact_paper_style",
              "break_even_randomized_paper_style"]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_bench_kv_smoke(tmp_path):
    path = tmp_path / "kv.json"
    result = run(json_path=str(path), lengths=[12], rank=2, dtype="fp32", device="cpu", progress=False,
                 preset="tiny", repeats=1)
    data = json.loads(path.read_text())  # strict JSON (no NaN/Infinity)
    assert data["benchmark"] == "kv"
    for key in ("torch", "transformers", "torch_threads", "cpu", "dtype", "device"):
        assert key in data["env"], key
    assert data["env"]["dtype"] == "fp32"
    assert data["config"]["model"]["num_key_value_heads"] == 2
    assert len(data["rows"]) == 1
    row = data["rows"][0]
    assert row["L"] == 12 and row["context"] == 12 and row["rank"] == 2
    for key in POSITIVE:
        assert _number(row[key]) and row[key] > 0, (key, row.get(key))
    for key in NON_NEGATIVE:
        assert _number(row[key]) and row[key] >= 0, (key, row.get(key))
    for key in MAYBE_NONE:
        assert key in row and (row[key] is None or (_number(row[key]) and row[key] > 0)), (key, row.get(key))
    # the patch must not be broken: closer to the conditioned KV than blind reuse
    assert row["recon_err_patch_exact"] < row["recon_err_blind"]
    # the labelled experiment computes the same thing as the production operator
    assert row["experimental_fused_rel_diff"] < 1e-5
    assert row["experimental_batched_rel_diff"] < 1e-5
    assert "| 12 |" in format_table(result)
