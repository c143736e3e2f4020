"""Layer-sparse refresh of stale survivors on real weights (SmolLM2-135M-Instruct), beside the token-sparse rules.

After a slide (evict the head chunk, admit a new one) the survivors keep KV conditioned on the evicted chunk. The
Window's repair rules recompute *some tokens in every layer* (CacheBlend / EPIC style: ``head``, ``sink:N``). A
layer-sparse refresh recomputes *every survivor token in the first L layers only*: a token's KV in layers < L
depends only on the layers < L of the tokens before it, so one forward of the survivors through the first L
layers over the exact prefix gives their exact KV there, at L / num_layers of a full refresh's compute. Layers
>= L keep the stale KV; the new chunk then runs whole over that window (what the step pays anyway). This measures
where such a refresh lies on the cost / fidelity front, against the token-sparse rules the Window ships, on the
same scenarios as ``bench/bench_repair.py`` (setting A: a system prompt, k = 5 chunks of ~110 tokens, one fact
each; setting B: k = 8 chunks of ~230 tokens).

The layer-sparse rows are formed by splicing: the exact window's KV in layers < L (what the truncated forward
computes), the keep-as-is window's KV in layers >= L, then the new chunk re-run over it. The ``deep:L`` rows (exact
in layers >= L, stale below) are a diagnostic of where the staleness that moves the answer lives; they are not
realizable cheaply (their hidden states need the full forward) and are not on the front.

    PYTHONPATH=. .venv/bin/python bench/bench_layer_refresh.py        # ~6 min, 2 threads

  cost share   (survivor tokens recomputed x layers / num_layers + new chunk + question)
               / (survivor tokens + new chunk + question): the step's prefill over a prefix cache's, in
               token-layers (attention over the window is not counted, as in bench_repair)
  mean KL      next-token KL(exact || window) at the question's last token (the answer's first token)
  same number  the greedy answer's number equals exact re-prefill's

Writes ``bench/results/layer_refresh.json``, ``bench/results/layer_refresh.md`` and ``docs/img/layer_refresh.png``
(``--table JSON`` redraws the table and the plot from a run's JSON).
"""
from __future__ import annotations

import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

import windowkit as wk
from bench._meta import short_commit, utc_stamp
from bench.bench_repair import _kl, _number, exact_window, scenario_args, scenario_chunks, system_prefix
from windowkit.kv import ChunkKV, concat
from windowkit.window import RepairRule

TOKEN_RULES = ["none", "sink:5", "head", "all"]  # the Window's own rules, run through the Window
SHALLOW = [1, 2, 4, 8, 15]  # layer-sparse refresh: survivors exact in layers < L
DEEP = [8, 15, 22]  # diagnostic: survivors exact in layers >= L only


def splice(low: ChunkKV, high: ChunkKV, cut: int) -> ChunkKV:
    """Layers < cut from ``low``, layers >= cut from ``high`` (same tokens, same positions)."""
    layers = [low.layers[i] if i < cut else high.layers[i] for i in range(len(low.layers))]
    return ChunkKV(layers, low.layout, low.positions)


def answer(backend, past: ChunkKV, start: int, qids: torch.Tensor, gen_tokens: int, sid: str):
    """Next-token logits after the question over ``past``, and the greedy continuation's ids."""
    q = wk.Chunk.text(qids, id=f"{sid}-q")
    res = backend.forward([q], start, past)
    logits, out = res.logits, []
    kv, pos = concat([past, res.kv]), start + len(qids)
    tok = int(logits.argmax())
    for i in range(gen_tokens):
        out.append(tok)
        if i + 1 == gen_tokens:
            break
        step = backend.forward([wk.Chunk.text(torch.tensor([tok]), id=f"{sid}-g{i}")], pos, kv)
        kv, pos, tok = concat([kv, step.kv]), pos + 1, int(step.logits.argmax())
    return logits, out


def run(setting: str, k: int, target_tokens: int, n: int, seed: int, backend, tok, gen_tokens: int) -> dict:
    rng = random.Random(seed)
    n_layers = backend.layout.num_layers
    prefix = system_prefix(tok)
    names = TOKEN_RULES + [f"layers:{L}" for L in SHALLOW] + [f"head+layers:{L}" for L in (2, 4)] + \
        [f"deep:{L}" for L in DEEP]
    rows = {r: {"cost": [], "kl": [], "same": []} for r in names}
    exact_right = 0
    for s in range(n):
        cs, qids, ans, target = scenario_chunks(tok, rng, k, target_tokens, s, f"L{setting}")
        ex = exact_window(backend, prefix, cs[1:])
        ex_kv, start = ex.window_kv(), ex.next_position
        ex_logits, ex_ids = answer(backend, ex_kv, start, qids, gen_tokens, f"L{setting}{s}-ex")
        ex_num = _number(tok, ex_ids)
        exact_right += ex_num == ans
        surv = sum(len(c) for c in cs[1:k])
        new, nq = len(cs[k]), len(qids)
        denom = surv + new + nq
        base = wk.Window(backend, prefix=prefix, repair="none")
        for c in cs[:k]:
            base.admit(c)
        stale_kv = None
        for r in TOKEN_RULES:  # through the Window: its own repair, its own forward
            w = base.fork()
            w.repair = RepairRule.parse(r)
            w.evict("head")
            w.admit(cs[k])
            kv = w.window_kv()
            if r == "none":
                stale_kv = kv
            logits, ids = answer(backend, kv, w.next_position, qids, gen_tokens, f"L{setting}{s}-{r}")
            rows[r]["cost"].append((w.stats.repaired_tokens + new + nq) / denom)
            rows[r]["kl"].append(_kl(ex_logits, logits))
            rows[r]["same"].append(_number(tok, ids) == ex_num)
        keep = ex_kv.num_tokens - new  # prefix + survivors
        head_n = len(cs[1])
        head_kv = None
        for name in names[len(TOKEN_RULES):]:
            kind, _, num = name.rpartition(":")
            L = int(num)
            if kind == "deep":
                past = splice(stale_kv, ex_kv, L).slice(0, keep)
                charged = surv  # needs the full forward: not realizable cheaply (diagnostic)
            else:
                low = ex_kv
                if kind == "head+layers":  # the head survivor whole (all layers), the rest through layers < L
                    if head_kv is None:
                        w = base.fork()
                        w.repair = RepairRule.parse("head")
                        w.evict("head")
                        w.admit(cs[k])
                        head_kv = w.window_kv()
                    high = head_kv
                    charged = head_n + (surv - head_n) * L / n_layers
                else:
                    high = stale_kv
                    charged = surv * L / n_layers
                past = splice(low, high, L).slice(0, keep)
            fresh = backend.forward([cs[k]], start - new, past).kv
            kv = concat([past, fresh])
            logits, ids = answer(backend, kv, start, qids, gen_tokens, f"L{setting}{s}-{name}")
            rows[name]["cost"].append((charged + new + nq) / denom)
            rows[name]["kl"].append(_kl(ex_logits, logits))
            rows[name]["same"].append(_number(tok, ids) == ex_num)
        print(f"[{setting}] scenario {s + 1}/{n}: " + ", ".join(f"{r} {rows[r]['kl'][-1]:.4f}" for r in names),
              flush=True)
    out = {"setting": setting, "k": k, "chunk_tokens": target_tokens, "n": n, "exact_right": exact_right,
           "num_layers": n_layers, "rules": {}}
    for r in names:
        x = rows[r]
        out["rules"][r] = {"cost_share": statistics.mean(x["cost"]), "mean_kl": statistics.mean(x["kl"]),
                           "max_kl": max(x["kl"]), "same_number": sum(x["same"]) / n}
    return out


def on_front(rules: dict, tol: float = 0.05) -> set:
    """Rules no other realizable rule beats: none as cheap with a KL within ``tol`` (relative) of theirs, or lower
    (deep:* excluded: not realizable cheaply). The tolerance keeps a dearer rule with the same KL off the front
    (``layers:1`` is ``none`` to float rounding: layer 0's KV depends on no other token)."""
    real = {k: v for k, v in rules.items() if not k.startswith("deep:")}

    def beats(o: dict, v: dict) -> bool:
        cheaper = o["cost_share"] < v["cost_share"] and o["mean_kl"] <= v["mean_kl"] * (1 + tol)
        closer = o["cost_share"] <= v["cost_share"] and o["mean_kl"] < v["mean_kl"] * (1 - tol)
        return cheaper or closer

    return {k for k, v in real.items() if not any(beats(o, v) for o in real.values() if o is not v)}


def table(results: list[dict]) -> str:
    head = "| rule | " + " | ".join(f"{r['setting']}: k={r['k']} x ~{r['chunk_tokens']} tok, N={r['n']} (exact right "
                                   f"{r['exact_right']}/{r['n']}): cost / mean KL / same number" for r in results)
    lines = [head + " |", "|---|" + "---|" * len(results)]
    fronts = [on_front(r["rules"]) for r in results]
    for rule in results[0]["rules"]:
        cells = []
        for r, fr in zip(results, fronts):
            x = r["rules"][rule]
            c = f"{x['cost_share']:.2f} / {x['mean_kl']:.4f} / {100 * x['same_number']:.0f} %"
            cells.append(f"**{c}**" if rule in fr else c)
        lines.append(f"| `{rule}` | " + " | ".join(cells) + " |")
    lines += ["", "**bold**: on the cost / KL front of the realizable rules (no cheaper rule within 5 % of its KL "
                  "and no rule as cheap with a lower one; `deep:L` is a diagnostic: exact KV in "
                  "layers >= L needs the full forward). `layers:L`: every survivor recomputed in the first L of "
                  f"{results[0]['num_layers']} layers; `head+layers:L`: the head survivor whole, the rest in the "
                  "first L layers."]
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Cost share (x) against mean KL (y, log) per rule, one panel per setting: the token-sparse rules, the
    layer-sparse ones (a line through L), and the ``deep:L`` diagnostic (hollow, not realizable cheaply)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 4.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        rules = r["rules"]
        pt = lambda name: (rules[name]["cost_share"], rules[name]["mean_kl"])  # noqa: E731
        token = [n for n in TOKEN_RULES if n != "all"]  # "all" is exact (KL 0 at 1.0): named in the corner
        for group, style, off in ((token, dict(marker="o", color="tab:blue", label="token-sparse (the Window's)"),
                                   (3, 4)),
                                  ([f"head+layers:{L}" for L in (2, 4)],
                                   dict(marker="s", color="tab:green", label="head + first L layers"), (3, -10))):
            xs, ys = zip(*(pt(n) for n in group))
            ax.scatter(xs, ys, **style)
            for n, x, y in zip(group, xs, ys):
                ax.annotate(n, (x, y), fontsize=7, xytext=off, textcoords="offset points", color=style["color"])
        lay = [f"layers:{L}" for L in SHALLOW]
        xs, ys = zip(*(pt(n) for n in lay))
        ax.plot(xs, ys, marker="^", color="tab:red", label="first L layers, every survivor")
        for L, x, y in zip(SHALLOW, xs, ys):
            if L >= 4:  # layers:1 and :2 sit on none
                ax.annotate(f"layers:{L}", (x, y), fontsize=7, xytext=(3, 4), textcoords="offset points",
                            color="tab:red")
        deep = [f"deep:{L}" for L in DEEP]
        xs, ys = zip(*(pt(n) for n in deep))
        ax.scatter(xs, ys, marker="D", facecolors="none", edgecolors="gray", label="deep:L (diagnostic)")
        for n, x, y in zip(deep, xs, ys):
            ax.annotate(n, (x, y), fontsize=7, xytext=(-40, 3), textcoords="offset points", color="gray")
        ax.set_yscale("log")
        ax.text(0.98, 0.02, "all: exact (KL 0) at 1.00", transform=ax.transAxes, ha="right", fontsize=7)
        ax.set_xlabel("prefill (token-layers) / prefix cache's")
        ax.set_ylabel("mean next-token KL vs exact re-prefill (nats)")
        ax.set_title(f"{r['setting']}: k = {r['k']} x ~{r['chunk_tokens']} tokens, N = {r['n']}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlim(0, 1.08)
    fig.suptitle("SmolLM2-135M: survivor repair after a slide, by token and by layer", fontsize=11)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = scenario_args(__doc__, "layer_refresh")
    ap.add_argument("--plot", default="docs/img/layer_refresh.png", help="write the cost / KL plot here ('' none)")
    ap.add_argument("--table", metavar="JSON", default=None, help="only rewrite --md (and --plot) from this JSON")
    args = ap.parse_args(argv)
    if args.table:
        got = json.loads(Path(args.table).read_text())
        meta, md = got["meta"], table(got["results"])
        Path(args.md).write_text(f"Layer-sparse refresh on real weights (commit {meta['commit']}, {meta['date']}, "
                                 f"{meta['wall_s']:.0f} s)\n\n" + md + "\n")
        if args.plot:
            plot(got["results"], args.plot)
        print(md)
        return 0
    torch.set_num_threads(args.threads)
    from windowkit.models import smollm2
    from windowkit.models.load import load_model

    backend = wk.HFBackend(load_model("smollm2"))
    tok = smollm2.load_tokenizer()
    t0 = time.time()
    results = []
    if args.n_a:
        results.append(run("A", 5, 110, args.n_a, args.seed, backend, tok, args.gen_tokens))
    if args.n_b:
        results.append(run("B", 8, 230, args.n_b, args.seed + 1, backend, tok, args.gen_tokens))
    md = table(results)
    print(md)
    meta = {"model": "SmolLM2-135M-Instruct", "threads": args.threads, "machine": platform.platform(),
            "commit": short_commit(), "date": utc_stamp(), "wall_s": time.time() - t0,
            "command": "PYTHONPATH=. .venv/bin/python bench/bench_layer_refresh.py"}
    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_path).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    Path(args.md).write_text(f"Layer-sparse refresh on real weights (commit {meta['commit']}, {meta['date']}, "
                             f"{meta['wall_s']:.0f} s)\n\n" + md + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
