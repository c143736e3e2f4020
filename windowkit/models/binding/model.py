"""The binding model: a small Qwen2.5-VL (transformers' own classes) sized for CPU training.

    model = build(seed=0)                  # random init, the training script's starting point
    model = load()                         # the committed checkpoint (safetensors + config.json)

Same architecture classes as transformers' Qwen2_5_VLForConditionalGeneration, small sizes: a 1-block
vision tower on 16-px patches with no spatial merge (one visual token per 16-px grid cell, 4 per frame),
a 4-layer GQA decoder of width 128 (4 query / 2 KV heads) with M-RoPE, a 48-token vocabulary (see
``task``). About 0.9 M parameters: 3.6 MB of fp32 safetensors.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from windowkit.errors import UnsupportedModelError
from windowkit.models.binding import task

CHECKPOINT_DIR = os.path.join(os.path.dirname(__file__), "checkpoint")


def config() -> Any:
    """The Qwen2_5_VLConfig of the binding model."""
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=task.VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=task.BOS, eos_token_id=task.EOS, pad_token_id=task.PAD,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                           patch_size=task.PATCH, spatial_merge_size=task.MERGE, temporal_patch_size=task.TEMPORAL,
                           window_size=task.FRAME, fullatt_block_indexes=[0], tokens_per_second=2),
        image_token_id=task.IMAGE, video_token_id=task.VIDEO, vision_start_token_id=task.VISION_START,
        vision_end_token_id=task.VISION_END, tie_word_embeddings=False)


def build(seed: int = 0) -> Any:
    """A freshly initialised binding model (seeded), fp32, in train mode."""
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config())


def load(path: Optional[str] = None) -> Any:
    """The trained model from ``path`` (default: the committed checkpoint folder), fp32, eval mode."""
    path = path or CHECKPOINT_DIR
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise UnsupportedModelError(f"no binding checkpoint at {path!r}: train one with "
                                    "`python -m windowkit.models.binding.train`")
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


__all__ = ["config", "build", "load", "CHECKPOINT_DIR"]
