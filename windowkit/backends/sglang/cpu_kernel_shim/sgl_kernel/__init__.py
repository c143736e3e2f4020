"""A stand-in for ``sgl_kernel`` (SGLang's compiled kernels) so that SGLang 0.5.23's CPU engine can start here.

Why it exists: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports eight names from ``sgl_kernel`` at module
level (KV-move and speculative-decoding helpers). No CPU build of ``sgl_kernel`` is on the package index
(the ``sgl-kernel`` / ``sglang-kernel`` wheels hold only CUDA libraries), and plain generation with the
``torch_native`` attention backend never calls any of them. This package defines exactly those eight
names and nothing else; each raises ``NotImplementedError`` when called, so nothing can pass because of
it: a code path that needs a real kernel fails loudly.

It is put on the path of the engine processes only (``windowkit.backends.sglang.cpu_engine`` adds this
folder's parent to ``PYTHONPATH``); it is not a package windowkit imports. See docs/backends.md.
"""
from __future__ import annotations

SHIM = True  # what this is: windowkit's CPU stand-in, not SGLang's kernels

_NAMES = (
    "copy_all_layer_kv_cache_cpu",  # sglang/kernels/ops/kvcache/cache_move.py
    "assign_req_to_token_pool_cpu",  # sglang/srt/mem_cache/allocation.py
    "assign_extend_cache_locs_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "assign_draft_cache_locs_contiguous_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "build_tree_kernel_efficient_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
    "verify_tree_greedy_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
    "fill_accept_out_cache_loc_cpu",  # sglang/kernels/ops/speculative/eagle.py
    "fill_bonus_tokens_cpu",  # sglang/kernels/ops/speculative/eagle.py
)


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is windowkit's CPU stand-in for sgl_kernel "
            "(windowkit/backends/sglang/cpu_kernel_shim): it has no kernels. This SGLang code path needs a "
            "real sgl_kernel build (CUDA, or SGLang's CPU/AMX build).")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


for _n in _NAMES:
    globals()[_n] = _missing(_n)
del _n

__all__ = list(_NAMES)
