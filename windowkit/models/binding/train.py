"""Train the binding model on CPU, deterministically, and write the checkpoint.

    python -m windowkit.models.binding.train                      # the committed checkpoint (~21 min, 1 thread)
    python -m windowkit.models.binding.train --steps 300 --out /tmp/ckpt   # a quick run

Fixed seeds everywhere (torch, the data stream ``make_item(seed, index)``), one CPU thread, no data
shuffling outside the seeded stream: the same command on the same torch build reproduces the same
weights bit for bit; other builds / CPUs agree up to float rounding (the accuracies, not the bytes).
Loss: cross-entropy on the answer tokens only. Each training sequence is the three frames followed by
``--questions`` question/answer pairs (``task.training_batch``): the first is in the evaluation's format,
the others reuse the same frames (the vision tower is most of the step's cost) for more supervision.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from windowkit.models.binding import model as binding_model
from windowkit.models.binding import task

TRAIN_SEED = 0  # data stream of the training items
HELDOUT_SEED = 1  # data stream of the held-out items (eval-binding, tests)


def accuracy(model, seed: int, n: int, bs: int = 64) -> dict:
    """Re-prefill accuracy per kind on items ``0..n-1`` of stream ``seed`` (answer argmax over its candidates)."""
    hits = {k: [0, 0] for k in task.KINDS}
    model.eval()
    with torch.no_grad():
        for lo in range(0, n, bs):
            items = [task.make_item(seed, i) for i in range(lo, min(n, lo + bs))]
            b = task.batch(items)
            logits = model(input_ids=b["input_ids"], pixel_values=b["pixel_values"],
                           image_grid_thw=b["image_grid_thw"], mm_token_type_ids=b["mm_token_type_ids"],
                           logits_to_keep=1).logits[:, -1]
            for it, row in zip(items, logits):
                cand = list(task.CANDIDATES[it.kind])
                pred = cand[int(row[cand].argmax())]
                hits[it.kind][0] += int(pred == it.answer)
                hits[it.kind][1] += 1
    model.train()
    return {k: (h / max(t, 1), t) for k, (h, t) in hits.items()}


def train(steps: int = 4000, batch_size: int = 32, lr: float = 5e-3, seed: int = 0, out: Optional[str] = None,
          eval_every: int = 250, progress: bool = True, questions: int = 8, aux: int = 0) -> dict:
    """Train from a seeded init; save to ``out`` (safetensors + config.json) and return a log dict."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = binding_model.build(seed)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    log: dict = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "questions": questions, "aux": aux,
                 "evals": []}
    t0 = time.perf_counter()
    bar = tqdm(range(steps), disable=not progress, desc="train-binding", mininterval=5)
    ema = None
    for step in bar:
        b = task.training_batch(TRAIN_SEED, range(step * batch_size, (step + 1) * batch_size), questions, aux)
        logits = model(input_ids=b["input_ids"], pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"],
                       mm_token_type_ids=b["mm_token_type_ids"], logits_to_keep=b["answer_positions"]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = float(loss) if ema is None else 0.98 * ema + 0.02 * float(loss)
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            acc = accuracy(model, HELDOUT_SEED, 256)
            log["evals"].append({"step": step + 1, "loss": ema, "seconds": time.perf_counter() - t0,
                                 **{k: a for k, (a, _) in acc.items()}})
            bar.write(f"step {step + 1}: loss {ema:.3f} " + " ".join(f"{k} {a:.3f}" for k, (a, _) in acc.items()))
    log["train_seconds"] = time.perf_counter() - t0
    log["torch"] = torch.__version__
    model.eval()
    if out:
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        for extra in ("generation_config.json",):
            p = os.path.join(out, extra)
            if os.path.exists(p):
                os.remove(p)
        size = os.path.getsize(os.path.join(out, "model.safetensors"))
        log["checkpoint_bytes"] = size
        with open(os.path.join(out, "train_log.json"), "w") as f:
            json.dump(log, f, indent=1)
    return log


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="train-binding", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=binding_model.CHECKPOINT_DIR)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--questions", type=int, default=8, help="question/answer pairs per training sequence")
    ap.add_argument("--aux", type=int, default=0, help="auxiliary 'did <colour> change?' questions per single-hop sequence")
    a = ap.parse_args(argv)
    log = train(a.steps, a.batch_size, a.lr, a.seed, a.out, a.eval_every, questions=a.questions, aux=a.aux)
    print(f"trained {a.steps} steps in {log['train_seconds']:.0f} s; checkpoint {log.get('checkpoint_bytes', 0)} bytes "
          f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
