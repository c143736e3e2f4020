"""SGLang adapter (first increment): layout conversions and KV-pool write/read.

Importing this package does not import sglang; only the pool calls touch sglang objects.

    from windowkit.backends.sglang import SGLangKVPool
    io = SGLangKVPool.from_config(token_to_kv_pool, backend.layout, model.config, tp_rank=r, tp_size=n)
    io.write(kv, loc)

See docs/backends.md for what is supported and the plan for the engine integration.
"""
from windowkit.backends.sglang.convert import (convert_pairing, half_to_interleaved, interleaved_to_half,
                                               kv_heads_for_rank, repair)
from windowkit.backends.sglang.pool import SGLangKVPool, slots_for_pages, standalone_parallel

__all__ = ["SGLangKVPool", "slots_for_pages", "standalone_parallel", "convert_pairing", "half_to_interleaved",
           "interleaved_to_half", "kv_heads_for_rank", "repair"]
