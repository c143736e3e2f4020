"""Tiny random-weight models built from config classes (no downloads): tests, demos, ``windowkit verify``.

    model = tiny.build("tiny-qwen2.5-vl")

Shapes follow the model families windowkit supports; weights are seeded so runs are reproducible.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

from windowkit.chunk import Chunk
from windowkit.errors import UnsupportedModelError


def _llama() -> Any:
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))


def _qwen2() -> Any:
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))


def _deepseek_v3() -> Any:
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=200, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=4096))


def _deepseek_v2() -> Any:
    return DeepseekV2ForCausalLM(DeepseekV2Config(
        vocab_size=200, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=48, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=4096))


_VL_IDS = dict(image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4)


def _qwen2_5_vl() -> Any:
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1], tokens_per_second=2),
        **_VL_IDS))


def _qwen3_vl() -> Any:
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [6, 5, 5]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        **_VL_IDS))


TINY_MODELS: dict[str, Callable[[], Any]] = {
    "tiny-llama": _llama,
    "tiny-qwen2": _qwen2,
    "tiny-deepseek-v3": _deepseek_v3,
    "tiny-deepseek-v2": _deepseek_v2,
    "tiny-qwen2.5-vl": _qwen2_5_vl,
    "tiny-qwen3-vl": _qwen3_vl,
}


def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """Build a tiny random model by name, seeded, in eval mode."""
    if name not in TINY_MODELS:
        raise UnsupportedModelError(f"unknown tiny model {name!r}; choose from {', '.join(TINY_MODELS)}")
    torch.manual_seed(seed)
    model = TINY_MODELS[name]()
    # random init is tiny (std 0.02): scale weights up so chunks condition each other measurably
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2 and "visual" not in n:
                p.mul_(4.0)
    return model.to(dtype).eval()


__all__ = ["TINY_MODELS", "build"]


def synthetic_image_chunk(model: Any, grid: tuple[int, int, int] = (1, 8, 8), seed: int = 0, id: str = "",
                          text_before: int = 0) -> "Any":
    """An image chunk for a tiny Qwen-VL model: [text..., <vision_start>, <image_pad> x n, <vision_end>]
    with random pixels of the right patch size (no processor, no downloads)."""
    cfg = model.config
    vc = cfg.vision_config
    t, h, w = grid
    merge = int(vc.spatial_merge_size)
    n_tokens = t * h * w // (merge * merge)
    g = torch.Generator().manual_seed(seed)
    row = 3 * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    pixels = torch.randn(t * h * w, row, generator=g)
    vocab = int(cfg.text_config.vocab_size)
    text = torch.randint(10, vocab, (text_before,), generator=g)
    ids = torch.cat([text, torch.tensor([cfg.vision_start_token_id]), torch.full((n_tokens,), cfg.image_token_id),
                     torch.tensor([cfg.vision_end_token_id])])
    return Chunk.image(ids, pixel_values=pixels.to(model.dtype), image_grid_thw=torch.tensor([list(grid)]), id=id)
