"""WindowkitLinker, the SGLang plugin and SGLangBackend's plan building, on CPU against SGLang's classes.

Real sglang 0.5.23 objects: ``MHATokenToKVPool`` / ``MLATokenToKVPool``, ``PagedTokenToKVPoolAllocator``,
``CacheInitParams``, ``PoolTransfer``, the chained page hashes (``get_storage_hash_str`` on a ``RadixKey``
with the request's ``cache_salt``) and the ``dynamic`` linker factory that builds the linker. Most tests
drive the linker through ``_serve``, the few steps of ``UnifiedCacheLinkerWrapper`` done by hand (match ->
lookup, load_back -> allocate + load, batch start -> layer-wise loading, finish); the last test lets
SGLang's own ``UnifiedRadixCache`` + wrapper drive it (one seam: ``get_disagg``). What only a GPU run adds
is a live scheduler: the plugin hook applied to the real ``Scheduler`` and a forward over restored pages.

Expected KV is computed independently with transformers' own forward on the tiny model (exact prefill,
and a chunk run alone at its window positions, which relocation must reproduce).
"""
from __future__ import annotations

import json
import os
from array import array
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from _need import need  # noqa: E402

need("sglang", "make .venv/.windowkit-sglang-installed (pip install --no-deps -r requirements-sglang.txt)")

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

import windowkit  # noqa: E402
from windowkit.backends.hf import HFBackend  # noqa: E402
from windowkit.backends.sglang import (PLAN_KEY, Segment, SGLangBackend, SGLangKVPool, WindowPlan,  # noqa: E402
                                       half_to_interleaved, linker_config, plan_request)
from windowkit.backends.sglang.linker import REGISTRY, WindowkitLinker  # noqa: E402
from windowkit.backends.sglang.plugin import HOOK_TARGET, on_generate_request, register  # noqa: E402
from windowkit.backends.tiny import build  # noqa: E402
from windowkit.chunk import Chunk  # noqa: E402
from windowkit.errors import UnsupportedModelError  # noqa: E402
from windowkit.kv import relocate_keys  # noqa: E402
from windowkit.window import Window  # noqa: E402

PAGE = 4
A = [5, 17, 33, 2, 90, 41, 7, 66, 12, 100, 3, 54]  # 12 tokens: 3 pages
B = [8, 77, 19, 120, 45, 6, 31, 88]  # 8 tokens: 2 pages
Q = [9, 60, 21]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build("tiny-qwen2", dtype=torch.float32)


@pytest.fixture(scope="module")
def hf(model):
    return HFBackend(model)


@pytest.fixture(autouse=True)
def fresh_registry():
    REGISTRY.clear()
    REGISTRY.stats_path = None
    yield
    REGISTRY.clear()


def _hf_kv(model, ids, start=0):
    """transformers' own cache for ``ids`` run alone at positions start.. : per layer (K, V) [H, S, D]."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                    use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]


class FakeEngine:
    """Records Engine.generate's keyword arguments (the request SGLangBackend sends)."""

    def __init__(self):
        self.calls = []

    def generate(self, **kw):
        self.calls.append(kw)
        return {"text": "", "meta_info": {}}


def _linker(page=PAGE, extra=None, layer_num=4, heads=2, dim=32, mla=False, size=256):
    if mla:
        pool = MLATokenToKVPool(size=size, page_size=page, dtype=torch.float32, kv_lora_rank=64, qk_rope_head_dim=16,
                                layer_num=layer_num, device="cpu", enable_memory_saver=False)
    else:
        pool = MHATokenToKVPool(size=size, page_size=page, dtype=torch.float32, head_num=heads, head_dim=dim,
                                layer_num=layer_num, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    alloc = PagedTokenToKVPoolAllocator(size, page, torch.float32, "cpu", pool, False)
    params = CacheInitParams(disable=False, token_to_kv_pool_allocator=alloc, page_size=page,
                             req_to_token_pool=ReqToTokenPool(size=4, max_context_len=size, device="cpu",
                                                              enable_memory_saver=False))
    cfg = linker_config(**(extra or {}))
    # SGLang's own factory for --unified-cache-external-linker-backend dynamic
    linker = create_unified_cache_linker(SimpleNamespace(), params, backend="dynamic", config=cfg,
                                         components={ComponentType.FULL}, forward_stream=None)
    return linker, alloc, pool


def _recv_req(kw, **over):
    """What the scheduler's handle_generate_request receives for Engine.generate(**kw)."""
    sp = SimpleNamespace(custom_params=kw["sampling_params"].get("custom_params"))
    req = SimpleNamespace(rid=kw["rid"], input_ids=array("q", kw["input_ids"]), sampling_params=sp,
                          cache_salt=kw.get("cache_salt"), extra_key=None, lora_id=None)
    for k, v in over.items():
        setattr(req, k, v)
    return req


def _serve(linker, alloc, req, device_hit_pages=0):
    """UnifiedCacheLinkerWrapper.match + load_back + batch start + finish_loads, for one request.

    Returns (restored pages, their slots, landed)."""
    key = RadixKey(array("q", list(req.input_ids)[:-1]), extra_key=req.extra_key, cache_salt=req.cache_salt)
    d = device_hit_pages * PAGE
    prior = None
    if d:  # the wrapper anchors the tail on the device node's last hash
        prior = get_storage_hash_str(key[:d], None, page_size=PAGE)[-1]
    tail_len = (len(key) - d) // PAGE * PAGE
    tail = get_storage_hash_str(key[d:d + tail_len], prior, page_size=PAGE) if tail_len else []
    restorable = linker.lookup(req.rid, [PoolTransfer(name=PoolName.KV, keys=list(tail))]) if tail else []
    hit = max(restorable, default=0)
    if hit == 0:
        return 0, None, True
    slots = alloc.alloc(hit * PAGE)
    assert linker.load(req.rid, [PoolTransfer(name=PoolName.KV, device_indices=slots, keys=list(tail[:hit]))])
    index = linker.start_layer_wise_loading()
    linker.layer_done_counter.set_consumer(index)  # what the forward does
    for layer in range(linker.num_layers):
        linker.layer_done_counter.wait_until(layer)  # get_key_buffer's wait: must not block
    return hit, slots, linker.finish_layer_wise_loading(index)


def _window(hf, mode):
    win = Window(hf, rank=4, mode=mode)
    win.admit(Chunk.text(torch.tensor(A), id="A"))
    win.admit(Chunk.text(torch.tensor(B), id="B"))
    return win


# ---------------------------------------------------------------------- applied plans
def test_exact_window_lands_as_the_models_own_kv(model, hf):
    """Exact window -> plan -> request -> plugin hook -> linker -> pool: the pool rows hold transformers'
    own prefill KV of A+B, slot by slot; an exact plan carries no salt (shareable with SGLang's prefill)."""
    engine = FakeEngine()
    sg = SGLangBackend(engine, hf, page_size=PAGE)
    sg.serve(_window(hf, "exact"), Q)
    kw = engine.calls[0]
    assert kw["input_ids"] == A + B + Q and "cache_salt" not in kw
    assert sg.last_plan.cache_salt is None and sg.last_plan.num_tokens == 20
    linker, alloc, pool = _linker(extra={"model_fingerprint": hf.fingerprint()})
    req = _recv_req(kw)
    on_generate_request(None, req)
    hit, slots, landed = _serve(linker, alloc, req)
    assert (hit, landed) == (5, True)  # all 20 window tokens, 5 pages; the query is prefilled by SGLang
    want = _hf_kv(model, A + B)
    for l, (k, v) in enumerate(want):
        torch.testing.assert_close(pool.k_buffer[l][slots], k.transpose(0, 1), atol=1e-5, rtol=0)
        torch.testing.assert_close(pool.v_buffer[l][slots], v.transpose(0, 1), atol=1e-5, rtol=0)
    s = REGISTRY.stats
    assert (s.plans, s.applied, s.pages_restored, s.tokens_restored, s.fallbacks) == (1, 1, 5, 20, 0)


def test_blind_window_relocated_chunk_matches_model_kv_at_its_position(model, hf):
    """Blind window: B's canonical relocated by 12 lands in the pool; it equals transformers' KV of B run
    alone at positions 12..19 (relocation is exact), and A's rows equal A's prefill. The approximate plan
    gets a salt, set on the request by the hook."""
    engine = FakeEngine()
    sg = SGLangBackend(engine, hf, page_size=PAGE)
    sg.serve(_window(hf, "blind"), Q)
    kw = engine.calls[0]
    salt = kw["cache_salt"]
    assert salt.startswith("windowkit-") and salt == sg.last_plan.cache_salt
    linker, alloc, pool = _linker()
    req = _recv_req(kw, cache_salt=None)  # the caller left it empty: the plugin sets the plan's
    on_generate_request(None, req)
    assert req.cache_salt == salt
    hit, slots, landed = _serve(linker, alloc, req)
    assert (hit, landed) == (5, True)
    want_a, want_b = _hf_kv(model, A), _hf_kv(model, B, start=12)
    canon_b = _hf_kv(model, B)
    for l in range(4):
        k = pool.k_buffer[l][slots].transpose(0, 1)  # [H, 20, D]
        v = pool.v_buffer[l][slots].transpose(0, 1)
        torch.testing.assert_close(k[:, :12], want_a[l][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(k[:, 12:], want_b[l][0], atol=1e-4, rtol=0)
        torch.testing.assert_close(k[:, 12:], relocate_keys(canon_b[l][0], 12, hf.rope), atol=1e-6, rtol=0)
        torch.testing.assert_close(v[:, 12:], canon_b[l][1], atol=1e-6, rtol=0)
    assert (want_b[0][0] - canon_b[0][0]).abs().max() > 0.1  # the relocation moved the keys measurably


def test_device_hit_restores_only_the_tail_at_its_offset(hf):
    """SGLang already holds the first 2 pages: the linker is asked about the tail only and writes plan
    rows 8..19 (the chained hashes give the absolute page offset)."""
    kv = _window(hf, "blind").window_kv()
    plan, kw = plan_request(kv, A + B, Q, page_size=PAGE, fingerprint=hf.fingerprint())
    linker, alloc, pool = _linker()
    req = _recv_req(kw)
    on_generate_request(None, req)
    hit, slots, landed = _serve(linker, alloc, req, device_hit_pages=2)
    assert (hit, landed) == (3, True)
    for l, (k, v) in enumerate(kv.layers):
        assert torch.equal(pool.k_buffer[l][slots], k[:, 8:20].transpose(0, 1))
        assert torch.equal(pool.v_buffer[l][slots], v[:, 8:20].transpose(0, 1))


def test_unaligned_window_end_restores_whole_pages_only(hf):
    """A window of 14 tokens on pages of 4: 3 pages restored, the 2 leftover tokens and the query are
    prefilled by SGLang (plan trimmed, not refused)."""
    win = Window(hf, rank=4, mode="blind")
    win.admit(Chunk.text(torch.tensor(A), id="A"))
    win.admit(Chunk.text(torch.tensor(B[:2]), id="B2"))
    engine = FakeEngine()
    sg = SGLangBackend(engine, hf, page_size=PAGE)
    before = hf.stats.extra.get("sglang_prefill_tokens", 0)
    plan, kw = sg.request(win, Q)
    assert plan.num_tokens == 12 and kw["input_ids"] == A + B[:2] + Q
    assert hf.stats.extra["sglang_prefill_tokens"] - before == 5  # 2 leftover window tokens + 3 query tokens
    linker, alloc, pool = _linker()
    req = _recv_req(kw)
    on_generate_request(None, req)
    assert _serve(linker, alloc, req)[0] == 3


def test_mla_plan_writes_latent_and_gptj_k_pe():
    """DeepSeek-V3 (MLA): the plan's k_pe (transformers half-split) is re-paired into SGLang's GPT-J pairs."""
    from windowkit.kv.layout import ChunkKV, KVLayout

    cfg = build("tiny-deepseek-v3").config
    lay = KVLayout("mla", 4, ((1, 64), (1, 16)), 1)
    g = torch.Generator().manual_seed(3)
    kv = ChunkKV([(torch.randn(1, 8, 64, generator=g), torch.randn(1, 8, 16, generator=g)) for _ in range(4)], lay)
    from windowkit.kv.rope import RopeSpec

    plan, kw = plan_request(kv, A[:8], Q, page_size=PAGE, fingerprint="ds", src_pairing="half",
                            pool_pairing=RopeSpec.from_config(cfg, engine="sglang").pairing)
    assert plan.pool_pairing == "interleaved"
    linker, alloc, pool = _linker(mla=True)
    req = _recv_req(kw)
    on_generate_request(None, req)
    hit, slots, landed = _serve(linker, alloc, req)
    assert (hit, landed) == (2, True)
    for l, (lat, kpe) in enumerate(kv.layers):
        row = pool.kv_buffer[l][slots]
        assert torch.equal(row[..., :64], lat.transpose(0, 1))
        assert torch.equal(row[..., 64:], half_to_interleaved(kpe).transpose(0, 1))


# ---------------------------------------------------------------------- cache_salt
def test_cache_salt_exact_vs_approximate_and_deterministic(hf):
    exact = _window(hf, "exact").window_kv()
    blind = _window(hf, "blind").window_kv()
    patch = _window(hf, "patch").window_kv()
    fp = hf.fingerprint()
    p_exact = WindowPlan.build(exact, A + B, page_size=PAGE, fingerprint=fp, mode="exact")
    p_blind = WindowPlan.build(blind, A + B, page_size=PAGE, fingerprint=fp)
    p_blind2 = WindowPlan.build(blind.clone(), A + B, page_size=PAGE, fingerprint=fp)
    p_patch = WindowPlan.build(patch, A + B, page_size=PAGE, fingerprint=fp)
    assert p_exact.cache_salt is None  # exact KV may share SGLang's namespace
    assert p_blind.cache_salt == p_blind2.cache_salt  # deterministic: same model, tokens, KV
    assert p_blind.cache_salt != p_patch.cache_salt  # different approximate KV -> different namespace
    assert p_blind.cache_salt != WindowPlan.build(blind, A + B, page_size=PAGE, fingerprint="other").cache_salt
    salted = WindowPlan.build(exact, A + B, page_size=PAGE, fingerprint=fp, mode="exact", share_exact=False)
    assert salted.cache_salt is not None
    # the approximate namespace is disjoint from the exact one: page hashes differ from the first page on
    plain = get_storage_hash_str(RadixKey(array("q", A + B)), None, page_size=PAGE)
    salty = get_storage_hash_str(RadixKey(array("q", A + B), cache_salt=p_blind.cache_salt), None, page_size=PAGE)
    assert not set(plain) & set(salty)


def test_exact_prefix_request_never_reads_approximate_pages(hf):
    """An approximate plan is registered; a plain request with the same tokens (no salt, its own rid)
    hashes into SGLang's shared namespace and finds nothing: it is prefilled exactly."""
    plan, kw = plan_request(_window(hf, "blind").window_kv(), A + B, Q, page_size=PAGE, fingerprint="m")
    linker, alloc, pool = _linker()
    on_generate_request(None, _recv_req(kw))
    plain = _recv_req({"rid": "plain", "input_ids": A + B + Q, "sampling_params": {}})
    assert _serve(linker, alloc, plain)[0] == 0
    assert REGISTRY.stats.fallbacks == 0  # not a windowkit request: nothing to count
    # a second salted request with the same plan (another rid) is found by its page hashes
    again = _recv_req(dict(kw, rid="again"))
    assert _serve(linker, alloc, again)[0] == 5


# ---------------------------------------------------------------------- fallbacks (exact re-prefill, counted)
def _fallback_case(hf, case, tmp_path):
    kv = _window(hf, "blind").window_kv()
    fp = hf.fingerprint()
    extra = {}
    over = {}
    segs = None
    spool = None
    if case == "misaligned":
        segs = [Segment(0, 6, "exact", "A"), Segment(6, 20, "approx", "B")]
    if case == "kv_missing":
        spool = str(tmp_path)
    if case == "fingerprint_mismatch":
        extra = {"model_fingerprint": "another-model"}
    plan, kw = plan_request(kv, A + B, Q, page_size=PAGE, fingerprint=fp, segments=segs, spool_dir=spool)
    if case == "kv_missing":
        os.remove(plan.kv_ref)
    if case == "token_mismatch":
        kw["input_ids"] = A + [B[0] + 1] + B[1:] + Q
    if case == "salt_mismatch":
        over["cache_salt"] = "someone-else"
    if case == "bad_plan":
        kw["sampling_params"]["custom_params"][PLAN_KEY] = json.dumps({"version": 1, "plan_id": "x"})
    if case == "page_size_mismatch":
        plan, kw = plan_request(kv, A + B, Q, page_size=2 * PAGE, fingerprint=fp)
    linker, alloc, pool = _linker(extra=extra, heads=1 if case == "layout_mismatch" else 2,
                                  dim=64 if case == "layout_mismatch" else 32)
    req = _recv_req(kw, **over)
    on_generate_request(None, req)
    if case == "hash_mismatch":  # the scheduler hashes the request in a namespace the hook did not see
        req.extra_key = "another-namespace"
    before = [pool.k_buffer[l].clone() for l in range(4)]
    hit, _, _ = _serve(linker, alloc, req)
    return hit, pool, before


@pytest.mark.parametrize("case", ["misaligned", "token_mismatch", "layout_mismatch", "fingerprint_mismatch",
                                  "kv_missing", "salt_mismatch", "bad_plan", "page_size_mismatch",
                                  "hash_mismatch"])
def test_unappliable_plans_fall_back_and_are_counted(hf, case, tmp_path):
    hit, pool, before = _fallback_case(hf, case, tmp_path)
    assert hit == 0  # nothing restored: SGLang prefills the whole prompt (exact re-prefill)
    for l in range(4):
        assert torch.equal(pool.k_buffer[l], before[l])
    s = REGISTRY.stats
    assert (s.fallbacks, dict(s.reasons), s.applied) == (1, {case: 1}, 0)


def test_lora_namespace_is_followed_by_the_hook(hf, tmp_path):
    """The hook hashes the plan under extra_key + lora_id, as SGLang's Req does: the plan applies."""
    plan, kw = plan_request(_window(hf, "blind").window_kv(), A + B, Q, page_size=PAGE, fingerprint="m")
    linker, alloc, pool = _linker()
    req = _recv_req(kw, extra_key="tenant-", lora_id="lora-7")
    on_generate_request(None, req)
    req.extra_key, req.lora_id = "tenant-lora-7", None
    assert _serve(linker, alloc, req)[0] == 5


def test_repeated_lookups_count_one_fallback_and_stats_file(hf, tmp_path):
    plan, kw = plan_request(_window(hf, "blind").window_kv(), A + B, Q, page_size=PAGE, fingerprint="m")
    stats = tmp_path / "stats.json"
    linker, alloc, pool = _linker(extra={"model_fingerprint": "other", "stats_path": str(stats)})
    req = _recv_req(kw)
    on_generate_request(None, req)
    for _ in range(3):  # the scheduler may match a waiting request several times
        assert _serve(linker, alloc, req)[0] == 0
    assert json.loads(stats.read_text())["reasons"] == {"fingerprint_mismatch": 1}


def test_failed_write_is_reported_by_finish_not_raised():
    """A write that fails during layer-wise loading fails the counter: finish() returns False (SGLang then
    aborts those requests) and the reason is counted; the forward's per-layer waits do not raise."""
    from windowkit.kv.layout import ChunkKV, KVLayout

    lay = KVLayout("gqa", 4, ((2, 32), (2, 32)), 0)
    kv = ChunkKV([(torch.randn(2, 8, 32), torch.randn(2, 8, 32)) for _ in range(4)], lay)
    plan, kw = plan_request(kv, A[:8], Q, page_size=PAGE, fingerprint="m")
    linker, alloc, pool = _linker()
    req = _recv_req(kw)
    on_generate_request(None, req)
    key = RadixKey(array("q", kw["input_ids"][:-1]), cache_salt=req.cache_salt)
    tail = get_storage_hash_str(key[:8], None, page_size=PAGE)
    assert linker.lookup(req.rid, [PoolTransfer(name=PoolName.KV, keys=tail)]) == [1, 2]
    bad = torch.arange(0, 8)  # the dummy page: SGLangKVPool refuses it
    assert linker.load(req.rid, [PoolTransfer(name=PoolName.KV, device_indices=bad, keys=tail)])
    index = linker.start_layer_wise_loading()
    linker.layer_done_counter.set_consumer(index)
    linker.layer_done_counter.wait_until(3)
    assert linker.finish_layer_wise_loading(index) is False
    assert dict(REGISTRY.stats.reasons) == {"load_error": 1}
    assert linker.start_layer_wise_loading() == -1  # nothing queued any more


def test_cancel_and_offload_contract():
    linker, alloc, pool = _linker()
    assert isinstance(linker, WindowkitLinker) and linker.pools[PoolName.KV] is pool
    assert linker.offload([PoolTransfer(name=PoolName.KV, device_indices=torch.arange(4, 8), keys=["h"])]) is False
    assert (linker.num_completed_offloads(), linker.pop_completed_offload()) == (0, False)
    assert linker.cancel_queued_load("nobody") is False
    assert linker.lookup("nobody", [PoolTransfer(name=PoolName.KV, keys=["00" * 32])]) == []
    linker.reset()
    linker.close()


# ---------------------------------------------------------------------- plugin and backend packaging
def test_plugin_entry_point_is_discoverable_and_registers_the_hook():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("windowkit") == "windowkit.backends.sglang.plugin:register"
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)  # SGLang's own discovery + ep.load()
    func, dist = found["windowkit"]
    assert func is register and dist == "windowkit"
    func()
    func()  # idempotent
    hooks = [(t, h) for t, h, _ in HookRegistry._hooks[HOOK_TARGET] if h is on_generate_request]
    assert hooks == [(HookType.BEFORE, on_generate_request)]


def test_hook_through_sglangs_before_wrapper_sets_the_salt_before_the_handler(hf):
    """The hook as SGLang's HookRegistry wraps a method (BEFORE): the plan is registered and the request
    reaches the original handler with the plan's cache_salt (from which the scheduler builds the Req).
    The real Scheduler module cannot be imported in the CPU venv (it needs the full dependency set)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    class Scheduler:  # stand-in with the real method's signature
        def handle_generate_request(self, recv_req, *, mm_input_error=None):
            self.seen = (recv_req.cache_salt, mm_input_error)

    Scheduler.handle_generate_request = _wrap_fn(Scheduler.handle_generate_request, on_generate_request,
                                                 HookType.BEFORE)
    plan, kw = plan_request(_window(hf, "blind").window_kv(), A + B, Q, page_size=PAGE, fingerprint="m")
    sched = Scheduler()
    sched.handle_generate_request(_recv_req(kw, cache_salt=None), mm_input_error=None)
    assert sched.seen == (plan.cache_salt, None) and plan.cache_salt is not None
    assert REGISTRY.stats.plans == 1 and REGISTRY.find(kw["rid"], [])[0].plan.plan_id == plan.plan_id


def test_hook_ignores_plain_requests_and_never_raises():
    on_generate_request(None, SimpleNamespace(rid="r", sampling_params=SimpleNamespace(custom_params=None)))
    on_generate_request(None, SimpleNamespace(rid="r"))
    on_generate_request(None, SimpleNamespace(rid="r", sampling_params=SimpleNamespace(
        custom_params={PLAN_KEY: "{not json"})))
    assert dict(REGISTRY.stats.reasons) == {"bad_plan": 1} and REGISTRY.stats.plans == 0


def test_sglang_backend_without_gpu_and_lazy_export(hf, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UnsupportedModelError):
        SGLangBackend.launch("/nonexistent", hf)
    assert windowkit.SGLangBackend is SGLangBackend
    code = "import sys, windowkit; windowkit.SGLangBackend; print(any(m.startswith('sglang') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.strip() == "False"


def test_sglang_backend_serves_the_window_protocol(hf):
    """Window works unchanged on SGLangBackend: its KV work runs on kv_backend (same numbers as HFBackend)."""
    sg = SGLangBackend(FakeEngine(), hf, page_size=PAGE)
    win = Window(sg, rank=4, mode="patch")
    win.admit(Chunk.text(torch.tensor(A), id="A"))
    win.admit(Chunk.text(torch.tensor(B), id="B"))
    ref = _window(hf, "patch")
    torch.testing.assert_close(win.forward(Q), ref.forward(Q), atol=1e-6, rtol=0)
    assert sg.layout == hf.layout and sg.fingerprint() == hf.fingerprint()


def test_plan_round_trips_through_json_and_pool_writer(hf, tmp_path):
    kv = _window(hf, "patch").window_kv()
    plan = WindowPlan.build(kv, A + B, page_size=PAGE, fingerprint="m", spool_dir=str(tmp_path))
    back = WindowPlan.from_json(json.dumps(plan.to_json()))
    assert back.to_json() == plan.to_json() and back.layout == hf.layout
    loaded = back.kv()
    for (k, v), (k2, v2) in zip(kv.layers, loaded.layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # layer-wise writes (what the linker does) equal one whole write
    p1 = MHATokenToKVPool(size=64, page_size=PAGE, dtype=torch.float32, head_num=2, head_dim=32, layer_num=4,
                          device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    io = SGLangKVPool(p1, hf.layout)
    loc = torch.arange(8, 28)
    for l in range(4):
        io.write(loaded, loc, layers=[l])
    for l, (k, v) in enumerate(kv.layers):
        assert torch.equal(p1.k_buffer[l][loc], k.transpose(0, 1))


# ---------------------------------------------------------------------- SGLang's own cache drives the linker
def test_sglang_unified_radix_cache_drives_the_linker(hf, model, monkeypatch):
    """SGLang's ``UnifiedRadixCache`` with the linker attached (``init_cache_linker``, as
    ``mem_cache/registry.py`` does) runs match_prefix -> lookup, init_load_back -> load and
    ready_to_load_host_cache -> layer-wise loading itself. Seam: ``get_disagg()`` (a published
    ServerArgs namespace, absent outside a server) is replaced by a non-disaggregated stub.
    After the request inserts its pages, a repeat with the plan's salt hits SGLang's device tree and a
    plain request with the same tokens does not."""
    import sglang.srt.mem_cache.unified_radix_cache as urc
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams

    monkeypatch.setattr(urc, "get_disagg", lambda: SimpleNamespace(disaggregation_mode="null"))
    pool = MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.float32, head_num=2, head_dim=32, layer_num=4,
                            device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    alloc = PagedTokenToKVPoolAllocator(256, PAGE, torch.float32, "cpu", pool, False)
    params = CacheInitParams(disable=False, token_to_kv_pool_allocator=alloc, page_size=PAGE,
                             req_to_token_pool=ReqToTokenPool(size=4, max_context_len=256, device="cpu",
                                                              enable_memory_saver=False),
                             tree_components=(ComponentType.FULL,))
    cache = urc.UnifiedRadixCache(params)
    linker = create_unified_cache_linker(SimpleNamespace(), params, backend="dynamic", config=linker_config(),
                                         components=set(cache.components))
    cache.init_cache_linker(linker)
    pool.register_layer_transfer_counter(linker.layer_done_counter)  # get_key_buffer waits per layer

    engine = FakeEngine()
    SGLangBackend(engine, hf, page_size=PAGE).serve(_window(hf, "blind"), Q)
    kw = engine.calls[0]
    recv = _recv_req(kw)
    on_generate_request(None, recv)

    def req(rid):
        return SimpleNamespace(rid=rid, session=None, last_node=None, kv=None, swa_branching_seqlen=None,
                               swa_host_hit_length=0, mamba_host_hit_length=0)

    r = req(recv.rid)
    key = RadixKey(array("q", kw["input_ids"][:-1]), cache_salt=recv.cache_salt)
    res = cache.match_prefix(MatchPrefixParams(key=key, req=r))
    assert (res.device_prefix_len, res.host_hit_length) == (0, 20)
    r.last_node = res.last_device_node
    n, _ = cache.init_load_back(InitLoadBackParams(best_match_node=res.last_host_node,
                                                   host_hit_length=res.host_hit_length, req=r))
    assert n == 20
    slots = cache.linker.private_load_indices[r.rid].clone()
    index = cache.ready_to_load_host_cache()
    linker.layer_done_counter.set_consumer(index)  # the forward's consumer index
    want_a, want_b = _hf_kv(model, A), _hf_kv(model, B, start=12)
    for l in range(4):
        k = pool.get_key_buffer(l)[slots].transpose(0, 1)  # waits on the linker's counter, like attention
        torch.testing.assert_close(k[:, :12], want_a[l][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(k[:, 12:], want_b[l][0], atol=1e-4, rtol=0)
    assert cache.finish_external_linker_loads([r]) == []  # landed: nothing to abort
    cache.insert(InsertParams(key=key[:20], value=slots))  # what the request does after its forward
    again = cache.match_prefix(MatchPrefixParams(key=key, req=req("again")))
    assert again.device_prefix_len == 20  # the plan's namespace: SGLang's own radix hit
    plain = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", kw["input_ids"][:-1])), req=req("plain")))
    assert (plain.device_prefix_len, plain.host_hit_length) == (0, 0)  # exact-prefix request: nothing approximate
    s = REGISTRY.stats
    assert (s.applied, s.tokens_restored, s.fallbacks) == (1, 20, 0)


def test_plans_sharing_leading_pages_each_restore_their_own(hf):
    """Two exact plans share their first pages (same chunk A, no salt): each request still finds its own plan
    by rid and restores every page of it; nothing falls back."""
    B2 = [t + 1 for t in B]
    kvs, reqs = [], []
    linker, alloc, pool = _linker()
    for i, second in enumerate((B, B2)):
        win = Window(hf, rank=4, mode="exact")
        win.admit(Chunk.text(torch.tensor(A), id="A"))
        win.admit(Chunk.text(torch.tensor(second), id=f"B{i}"))
        kv = win.window_kv()
        plan, kw = plan_request(kv, A + second, Q, page_size=PAGE, fingerprint=hf.fingerprint(), mode="exact",
                                rid=f"r{i}")
        assert plan.cache_salt is None  # unsalted: the two plans' first 3 page hashes are equal
        req = _recv_req(kw)
        on_generate_request(None, req)
        kvs.append(kv)
        reqs.append(req)
    fallbacks = REGISTRY.stats.fallbacks
    for kv, req in zip(kvs, reqs):
        hit, slots, landed = _serve(linker, alloc, req)
        n = hit * PAGE
        assert landed and n == (len(A) + len(B)) // PAGE * PAGE
        for l, (k, v) in enumerate(kv.layers):
            assert torch.equal(pool.k_buffer[l][slots], k[:, :n].transpose(0, 1))
    assert REGISTRY.stats.fallbacks == fallbacks
