"""``windowkit eval-binding``: accuracy of the binding model per reuse strategy and question kind.

    python -m windowkit.models.binding.eval --n 200 --json bench/results/binding.json

For every held-out item (stream ``HELDOUT_SEED``, never trained on) the three frame chunks are put in a
windowkit ``Window`` behind a one-token BOS prefix and the question is asked with ``Window.forward``:

  reprefill   mode="exact": the whole window re-prefilled (the ceiling)
  blind       mode="blind": each frame's KV computed alone, relocated by R(δ), no patch
  rank4/16/64 mode="patch", rank m: a first window forms and stores each frame's patch on its context;
              a second window over the same store places every frame as R(δ)(KV(B|∅) + U_m V_mᵀ)
              (zero forwards at placement: ``stats.patch_reuses == 3`` is checked)
  blend15     token recompute (CacheBlend-style) at 15%: in each frame chunk, the ceil(15%) tokens whose
              blind KV deviates most from the in-context KV (summed over layers, K and V) get their
              in-context KV; the others stay blind. Oracle selection and in-context values: an upper
              bound on what CacheBlend's own selector and partial recompute reach at that budget.

The answer is the argmax of the next-token logits over the kind's candidates (colours for single_hop,
shapes for multi_hop), so chance is exactly 1/6 and 1/4. Intervals are Wilson 95%.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any, Optional, Sequence

import torch
from tqdm import tqdm

from windowkit.backends.hf import HFBackend
from windowkit.chunk import Chunk
from windowkit.errors import WindowkitError
from windowkit.kv.layout import concat
from windowkit.kv.patch import place
from windowkit.models.binding import task
from windowkit.models.binding.model import load
from windowkit.models.binding.train import HELDOUT_SEED
from windowkit.store import ChunkStore
from windowkit.window import Window

STRATEGIES = ("reprefill", "blind", "rank4", "rank16", "rank64", "blend15")
CHANCE = {k: 1.0 / len(v) for k, v in task.CANDIDATES.items()}


from windowkit.kv.metrics import wilson  # noqa: E402  (one copy; re-exported here)


def _answer(logits: torch.Tensor, kind: str) -> int:
    cand = list(task.CANDIDATES[kind])
    return cand[int(logits[cand].argmax())]


def _blend_logits(backend: Any, prefix, chunks, question, fraction: float) -> torch.Tensor:
    """Logits after the window with each frame's blind KV blended: the top ``fraction`` most-deviating
    tokens of each chunk take their in-context KV (see the module docstring)."""
    full = backend.forward([prefix, *chunks], 0)  # in-context KV of every token, spans per chunk
    parts = [full.kv.slice(0, len(prefix))]
    lo, start = len(prefix), full.spans[0]
    for c, span in zip(chunks, full.spans[1:]):
        cond = full.kv.slice(lo, lo + len(c))
        blind = place(backend.encode(c), start, backend.rope)
        dev = sum(((a.float() - b.float()) ** 2).sum(dim=(0, 2)) + ((x.float() - y.float()) ** 2).sum(dim=(0, 2))
                  for (a, x), (b, y) in zip(cond.layers, blind.layers))  # [S] per token
        k = max(1, math.ceil(fraction * len(c)))
        pick = torch.zeros(len(c), dtype=torch.bool)
        pick[dev.topk(k).indices] = True
        layers = [(torch.where(pick[None, :, None], a, b), torch.where(pick[None, :, None], x, y))
                  for (a, x), (b, y) in zip(cond.layers, blind.layers)]
        parts.append(type(cond)(layers, cond.layout, cond.positions))
        lo += len(c)
        start += span
    q = Chunk.text(torch.tensor(question), id="__question__")
    res = backend.forward([q], start, concat(parts))
    backend.forget(q)
    return res.logits


def item_predictions(backend: Any, item: task.Item, tag: str, strategies: Sequence[str] = STRATEGIES) -> dict:
    """Predicted answer token per strategy for one item (``tag`` makes chunk ids unique)."""
    prefix = Chunk.text(torch.tensor([task.BOS]), id="__bos__")
    chunks = [task.frame_chunk(item, k, id=f"{tag}-f{k + 1}") for k in range(task.N_FRAMES)]
    out = {}
    for s in strategies:
        if s in ("reprefill", "blind"):
            win = Window(backend, mode="exact" if s == "reprefill" else "blind", prefix=prefix, rank=None)
            for c in chunks:
                win.admit(c)
            logits = win.forward(item.question)
        elif s.startswith("rank"):
            rank = int(s[4:])
            store = ChunkStore(model_fingerprint=backend.fingerprint(), layout=backend.layout)
            # eager: the first window forms and stores a patch per frame (lazy forming would store none)
            first = Window(backend, store=store, rank=rank, mode="patch", prefix=prefix, form="eager")
            for c in chunks:
                first.admit(c)  # conditioned forward per frame; the patch is formed and stored
            win = Window(backend, store=store, rank=rank, mode="patch", prefix=prefix, form="eager")
            for c in chunks:
                win.admit(c)  # stored canonical + stored patch: zero forwards
            if win.stats.patch_reuses != len(chunks):  # every frame must come from its stored patch
                raise WindowkitError(f"rank{rank}: {win.stats.patch_reuses} of {len(chunks)} frames reused a patch")
            logits = win.forward(item.question)
        elif s.startswith("blend"):
            logits = _blend_logits(backend, prefix, chunks, item.question, int(s[5:]) / 100)
        else:
            raise WindowkitError(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
        out[s] = _answer(logits, item.kind)
    for c in chunks:
        backend.forget(c)
    return out


def evaluate(model: Any = None, n: int = 100, seed: int = HELDOUT_SEED, strategies: Sequence[str] = STRATEGIES,
             progress: bool = False, per_item: Optional[list] = None) -> dict:
    """Accuracy per kind and strategy on ``n`` held-out items of each kind.

        res = evaluate(n=50)      # {"multi_hop": {"reprefill": {"accuracy", "n", "ci95"}, ...}, "single_hop": ...}
    """
    model = model if model is not None else load()
    backend = HFBackend(model)
    hits = {k: {s: 0 for s in strategies} for k in task.KINDS}
    todo = [(kind, i) for kind in ("multi_hop", "single_hop") for i in range(n)]
    for kind, i in tqdm(todo, disable=not progress, desc="eval-binding", mininterval=5):
        item = task.make_item(seed, 1_000_000 * (kind == "single_hop") + i, kind)
        preds = item_predictions(backend, item, f"{kind}{i}", strategies)
        for s, p in preds.items():
            hits[kind][s] += int(p == item.answer)
        if per_item is not None:
            per_item.append({"kind": kind, "answer": item.answer, **preds})
    return {kind: {s: {"accuracy": hits[kind][s] / n if n else 0.0, "n": n, "ci95": wilson(hits[kind][s], n)}
                   for s in strategies} for kind in ("multi_hop", "single_hop")}


def table(res: dict) -> str:
    """A markdown table of an ``evaluate`` result (accuracy [95% CI], n, chance per kind)."""
    kinds = list(res)
    strategies = list(res[kinds[0]])
    lines = ["| strategy | " + " | ".join(f"{k} (chance {CHANCE[k]:.3f})" for k in kinds) + " |",
             "|---|" + "---|" * len(kinds)]
    for s in strategies:
        cells = [f"{res[k][s]['accuracy']:.3f} [{res[k][s]['ci95'][0]:.3f}, {res[k][s]['ci95'][1]:.3f}] "
                 f"n={res[k][s]['n']}" for k in kinds]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flips(per_item: list, kind: str = "multi_hop") -> str:
    """How many items blind reuse flips away from the re-prefill answer, and how many each strategy restores."""
    rows = [r for r in per_item if r["kind"] == kind and "blind" in r and "reprefill" in r]
    flipped = [r for r in rows if r["blind"] != r["reprefill"]]
    parts = [f"{kind}: blind changes the re-prefill answer on {len(flipped)}/{len(rows)} items"]
    for s in rows[0] if rows else []:
        if s not in ("kind", "answer", "reprefill", "blind"):
            parts.append(f"{s} restores {sum(r[s] == r['reprefill'] for r in flipped)}/{len(flipped)}")
    return "; ".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="eval-binding", description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100, help="held-out items per question kind")
    ap.add_argument("--json", default=None, help="write the result JSON here")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the committed one)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    per_item: list = []
    res = evaluate(load(a.model), a.n, strategies=[s for s in a.strategies.split(",") if s], progress=True,
                   per_item=per_item)
    print(table(res))
    for kind in ("multi_hop", "single_hop"):
        print(flips(per_item, kind))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
