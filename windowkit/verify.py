"""``windowkit verify``: a fidelity table per model, against the model's own re-prefill.

For each model and trial: an antecedent chunk A, a chunk B and a short query q.
  ceiling   one forward over [A · B · q]                                   (re-prefill)
  blind     KV(A) + R(δ)·KV(B|∅), then q                                   (relocate only)
  rank m    KV(A) + R(δ)·(KV(B|∅) + U_m V_mᵀ), then q                       (the patch)
Reports the relocation error (R(δ)·KV(B|∅) vs the model's own KV(B|∅) at δ, layer 0), next-token KL to the ceiling,
eta (fraction of the blind gap closed) and patch bytes as % of B's KV.

    windowkit verify --model tiny-llama --model /path/to/local/checkpoint
    windowkit verify --model smollm2      # real trained weights, real text in the model's chat template

Tiny random models get random token chunks; ``smollm2`` (and a local checkpoint folder with a tokenizer and
a chat template) gets English passages: A opens the user turn, B follows, q asks a question and opens the
assistant turn.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Optional, Sequence

import torch
import transformers
from tqdm import tqdm

from windowkit.backends.hf import HFBackend
from windowkit.backends.tiny import synthetic_image_chunk
from windowkit.chunk import Chunk
from windowkit.kv.layout import concat
from windowkit.kv.metrics import eta, kl_divergence
from windowkit.kv.patch import form_orbit_patch, form_patch, orderings, place
from windowkit.models.load import load_model
from windowkit.models.smollm2 import load_tokenizer
from windowkit.models.texts import PASSAGES, QUESTIONS

DEFAULT_MODELS = ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-deepseek-v3", "tiny-llama", "tiny-qwen2"]
DEFAULT_RANKS: list[Optional[int]] = [1, 4, 16, 32, 64, None]


def _text_chunks(tok: Any, seed: int, n: int = 3) -> list[Chunk]:
    """``n`` real-text chunks: chat header + passage, passages, then a question closing the user turn."""
    msgs = [{"role": "user", "content": "\x00"}]
    shell = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    head, tail = shell.split("\x00")
    ps = [PASSAGES[(seed + i) % len(PASSAGES)] for i in range(n - 1)]
    texts = [head + ps[0]] + ["\n\n" + p for p in ps[1:]] + ["\n\n" + QUESTIONS[seed % len(QUESTIONS)] + tail]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    names = ["A", "B", "q"] if n == 3 else [f"x{i}" for i in range(n - 1)] + ["q"]
    return [Chunk.text(torch.tensor(x), id=f"{nm}{seed}") for nm, x in zip(names, ids)]


def _tokenizer_for(name: str) -> Any:
    """The tokenizer of a real text model (smollm2, or a local folder with a chat template); None otherwise."""
    if name == "smollm2":
        return load_tokenizer()

    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "tokenizer_config.json")):
        tok = transformers.AutoTokenizer.from_pretrained(name)
        return tok if getattr(tok, "chat_template", None) else None
    return None


def _chunks(backend: HFBackend, seed: int, tok: Any = None) -> tuple[Chunk, Chunk, Chunk]:
    if tok is not None and backend.model_type not in ("qwen2_5_vl", "qwen3_vl"):
        a, b, q = _text_chunks(tok, seed)
        return a, b, q
    g = torch.Generator().manual_seed(seed)
    vocab = backend.vocab_size
    lo = 10

    def text(n: int, tag: str) -> Chunk:
        return Chunk.text(torch.randint(lo, vocab, (n,), generator=g), id=f"{tag}{seed}")

    if backend.model_type in ("qwen2_5_vl", "qwen3_vl"):
        grid = (1, 16, 16)  # 256 patches -> 64 merged image tokens (both Qwen-VL families merge 2x2)
        a = synthetic_image_chunk(backend.model, grid, seed=1000 + seed, id=f"A{seed}", text_before=8)
        b = synthetic_image_chunk(backend.model, grid, seed=2000 + seed, id=f"B{seed}", text_before=8)
        return a, b, text(8, "q")
    return text(64, "A"), text(64, "B"), text(8, "q")


def verify_model(name: str, ranks: Sequence[Optional[int]] = DEFAULT_RANKS, trials: int = 3,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", model: Any = None, orbit: bool = True) -> dict:
    """Fidelity numbers for one model, averaged over ``trials`` random (A, B, q) triples.
    ``orbit=False`` skips the reorder measurement (36 forwards, the slow part on a real model)."""
    model = model if model is not None else load_model(name, dtype=dtype, device=device)
    be = HFBackend(model)
    tok = _tokenizer_for(name)
    rows: dict[str, list[float]] = {"reloc_err": [], "kl_blind": []}
    for r in ranks:
        rows[f"kl_r{r or 'full'}"] = []
        rows[f"bytes_r{r or 'full'}"] = []
    for t in range(trials):
        a, b, q = _chunks(be, t, tok)
        full = be.forward([a, b, q], 0)
        ref = full.logits
        ra = be.forward([a], 0)
        delta = ra.spans[0]
        cond = be.forward([b], delta, past=ra.kv).kv
        canon = be.encode(b)
        own = be.forward([b], delta).kv  # the model's own KV(B|∅) placed at δ
        moved = canon.relocate(delta, be.rope)
        rs = be.layout.rope_slot
        # layer 0: keys there depend on content and position only, so this is the relocation error proper;
        # deeper layers add the model's own rounding across positions (large in bf16 for MoE routers)
        m0, o0 = moved.layers[0][rs].float(), own.layers[0][rs].float()
        err = float((m0 - o0).norm() / o0.norm().clamp_min(1e-30))
        rows["reloc_err"].append(err)
        qstart = delta + be.span(b)

        def kl_with(kv_b) -> float:
            return kl_divergence(ref, be.forward([q], qstart, past=concat([ra.kv, kv_b])).logits)

        rows["kl_blind"].append(kl_with(place(canon, delta, be.rope)))
        for r in ranks:
            p = form_patch(cond, canon, delta, be.rope, r)
            rows[f"kl_r{r or 'full'}"].append(kl_with(place(canon, delta, be.rope, p)))
            rows[f"bytes_r{r or 'full'}"].append(100.0 * p.fraction_of(canon))
        for c in (a, b, q):
            be.forget(c)
    out = {k: sum(v) / len(v) for k, v in rows.items()}
    if orbit:
        out.update(_orbit_k3(be, tok=tok))
    out["layout"] = be.layout.describe()
    out["model"] = name
    out["text"] = "real text, chat template" if tok is not None else "random tokens"
    out["chunk_tokens"] = len(_chunks(be, 0, tok)[1])
    for r in ranks:
        out[f"eta_r{r or 'full'}"] = eta(out["kl_blind"], out[f"kl_r{r or 'full'}"])
    return out


def _orbit_k3(be: HFBackend, rank: int = 16, tok: Any = None) -> dict:
    """Reorder at K=3: the orbit patch (mean deficit over the other 5 orderings, the test ordering held
    out) against the test ordering's own patch, both as eta over blind reuse, averaged over the 6 tests."""
    if tok is not None:  # passages without the chat header (a header would move with the permutations)
        def tc(text: str, cid: str) -> Chunk:
            return Chunk.text(torch.tensor(tok(text, add_special_tokens=False).input_ids), id=cid)

        xs = [tc(" " + PASSAGES[4 + i].split(". ")[0] + ".", f"x{i}") for i in range(3)]
        b, q = tc(" " + PASSAGES[1], "orbitB"), tc("\n" + QUESTIONS[0], "orbitQ")
    else:
        g = torch.Generator().manual_seed(123)
        vocab = be.vocab_size
        xs = [Chunk.text(torch.randint(10, vocab, (16,), generator=g), id=f"x{i}") for i in range(3)]
        b = Chunk.text(torch.randint(10, vocab, (32,), generator=g), id="orbitB")
        q = Chunk.text(torch.randint(10, vocab, (6,), generator=g), id="orbitQ")
    delta = sum(be.span(x) for x in xs)
    canon = be.encode(b)
    cond = {}
    for perm in orderings(range(3)):
        kv = be.forward([xs[i] for i in perm] + [b], 0).kv
        cond[perm] = kv.slice(kv.num_tokens - len(b), kv.num_tokens)
    eo, ee = [], []
    for test in cond:
        ctx = [xs[i] for i in test]
        ref = be.forward(ctx + [b, q], 0).logits
        kv_ctx = be.forward(ctx, 0).kv

        def kl(kv_b) -> float:
            return kl_divergence(ref, be.forward([q], delta + be.span(b), past=concat([kv_ctx, kv_b])).logits)

        kb = kl(place(canon, delta, be.rope))
        orbit = form_orbit_patch([cond[p] for p in cond if p != test], canon, delta, be.rope, rank)
        eo.append(eta(kb, kl(place(canon, delta, be.rope, orbit))))
        ee.append(eta(kb, kl(place(canon, delta, be.rope, form_patch(cond[test], canon, delta, be.rope, rank)))))
    for c in xs + [b, q]:
        be.forget(c)
    return {"eta_orbit_k3": sum(eo) / len(eo), "eta_exact_k3": sum(ee) / len(ee)}


def format_table(results: Sequence[dict], ranks: Sequence[Optional[int]] = DEFAULT_RANKS) -> str:
    names = [f"r{r or 'full'}" for r in ranks]
    head = "| model | text | layout | B tokens | reloc err | KL blind | " + " | ".join(f"KL {n}" for n in names) + " |"
    sep = "|" + "---|" * (6 + len(names))
    lines = ["### next-token KL to re-prefill (lower is better)", "", head, sep]
    for r in results:
        lines.append(f"| {r['model']} | {r.get('text', 'random tokens')} | {r['layout']} | {r['chunk_tokens']} | {r['reloc_err']:.1e} | {r['kl_blind']:.2e} | "
                     + " | ".join(f"{r['kl_' + n]:.2e}" for n in names) + " |")
    lines += ["", "### eta (fraction of the blind gap closed) and patch bytes (% of the chunk's KV)", "",
              "| model | " + " | ".join(f"eta {n}" for n in names) + " | " + " | ".join(f"bytes {n}" for n in names) + " |",
              "|" + "---|" * (1 + 2 * len(names))]
    for r in results:
        lines.append(f"| {r['model']} | " + " | ".join(f"{r['eta_' + n]:.3f}" for n in names) + " | "
                     + " | ".join(f"{r['bytes_' + n]:.1f}%" for n in names) + " |")
    lines += ["", "### reorder at K=3, rank 16: orbit patch (test ordering held out) vs the ordering's own patch", "",
              "| model | eta orbit | eta exact |", "|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r.get('eta_orbit_k3', float('nan')):.3f} | {r.get('eta_exact_k3', float('nan')):.3f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="windowkit verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="tiny model name or local checkpoint path (repeatable)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", dest="json_path", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    models = args.model or DEFAULT_MODELS
    results = []

    for name in tqdm(models, desc="verify", unit="model", file=sys.stderr):
        t0 = time.time()
        res = verify_model(name, trials=args.trials, dtype=dtype, device=args.device)
        res["seconds"] = round(time.time() - t0, 2)
        results.append(res)
    print(format_table(results))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    return 0


__all__ = ["verify_model", "format_table", "main", "DEFAULT_MODELS"]
