#!/usr/bin/env bash
# GPU check for the SGLang adapter (issue 8). PREPARED, UNTESTED: written on a CPU-only machine.
#
# Needs: one CUDA GPU, sglang==0.5.23 with its full dependencies (CUDA 13), windowkit importable
# (pip install -e . or PYTHONPATH=.), pytest. No downloads: the model is random weights from a local config.
#
#   bash scripts/gpu_check.sh                  # results in $OUT (default ./gpu_check_out)/gpu_check.json
#
# Stages (each independent; a failing stage is recorded and the next one still runs):
#   0  the CPU adapter tests (tests/test_sglang_adapter.py)
#   1  kernels: SGLangKVPool writes into device="cuda" pools (SGLang's CUDA store_cache / Triton MLA
#      kernels) read back bit-identical; SGLang's CUDA rotary kernel (forward_cuda) vs windowkit relocation
#   2  engine: sglang.Engine on a random-weight Qwen2.5-VL-shaped model (--load-format dummy) runs
#      [A | B | q] by full prefill (next-token top-k logprobs, TTFT) and again prefix-cached
#   3  windowkit splice + patch through the linker: SKIPPED until windowkit/backends/sglang/linker.py exists
#      (then: next-token KL vs stage 2 and the TTFT ratio windowkit / full prefill)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
PY="${PYTHON:-python3}"
unset SGLANG_USE_CPU_ENGINE

echo "== stage 0: CPU adapter tests"
timeout 600 "$PY" -m pytest -q -p no:cacheprovider tests/test_sglang_adapter.py > "$OUT/stage0_pytest.txt" 2>&1
echo "stage0 rc=$?" | tee "$OUT/stage0_rc.txt"
tail -3 "$OUT/stage0_pytest.txt"

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


@stage("stage3_windowkit_splice")
def _splice():
    import importlib.util

    if importlib.util.find_spec("windowkit.backends.sglang.linker") is None:
        return {"skipped": "windowkit.backends.sglang.linker (the UnifiedCacheLinker plugin) is not built yet; "
                           "see docs/backends.md, 'Plan: engine integration'"}
    raise NotImplementedError("linker found: wire it here (launch with --enable-unified-cache-external-linker "
                              "--unified-cache-external-linker-backend dynamic ...), compare next-token KL "
                              "against stage2 and report ttft_windowkit / ttft_full_prefill")


with open(os.path.join(OUT, "gpu_check.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
print("wrote", os.path.join(OUT, "gpu_check.json"))
PYEOF
echo "stages rc=$?"
