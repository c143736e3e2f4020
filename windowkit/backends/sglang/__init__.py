"""SGLang adapter: layout conversions, KV-pool write/read, window plans, the linker plugin, SGLangBackend.

Importing this package does not import sglang; only the pool calls touch sglang objects. The linker
(``windowkit.backends.sglang.linker``) and the plugin (``.plugin``) import sglang and are loaded by SGLang.

    from windowkit.backends.sglang.pool import SGLangKVPool
    io = SGLangKVPool.from_config(token_to_kv_pool, backend.layout, model.config, tp_rank=r, tp_size=n)
    io.write(kv, loc)

See docs/backends.md for what is supported and the plan for the engine integration.
"""
from windowkit.backends.sglang.convert import (convert_pairing, half_to_interleaved, interleaved_to_half,
                                               kv_heads_for_rank, repair)
from windowkit.backends.sglang.backend import SGLangBackend, linker_config, plan_request
from windowkit.backends.sglang.plan import PLAN_KEY, Segment, WindowPlan, derive_cache_salt
from windowkit.backends.sglang.pool import SGLangKVPool, slots_for_pages, standalone_parallel

# the public names (docs/api.md); the others imported above stay importable from here and from their modules
__all__ = ["SGLangBackend"]
