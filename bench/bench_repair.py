"""Survivor repair on real weights (SmolLM2-135M-Instruct): cost share vs a prefix cache, KL vs exact, answers.

    PYTHONPATH=. .venv/bin/python bench/bench_repair.py --json bench/results/repair.json --md bench/results/repair.md

An earlier hand-run probe of selective recompute (SmolLM2, short records behind a system prompt: after a head
eviction, how much of the survivors' KV must be recomputed to match an exact re-prefill; docs/window.md, "Survivor
repair on real weights"), run through the Window itself: a system prompt (the Window's
fixed prefix), k chunks of short records (each record one fact with a number), evict the head, admit one
new chunk, then one question asking for one number (rotating over a record in the first survivor, a middle
survivor, the last survivor and the new chunk). Each chunk is one record padded with number-free filler sentences. Setting A: k=5
chunks of ~110 tokens; setting B: k=8 chunks of ~230 tokens. For each repair rule the same window (admitted once, then forked) takes the evict + admit
with that rule; the reference is an exact re-prefill of prefix + survivors + new chunk + question.

  cost share     (repaired survivor tokens + new chunk + question) / (survivor tokens + new chunk + question):
                 the prefill the step pays over what a prefix cache pays after a head eviction (it recomputes
                 every survivor)
  mean KL        next-token KL(exact || window) at the query's last token (the assistant turn is opened with
                 "The number is", so that token is the answer's first token), mean over scenarios
  same number    the greedy answer's first number equals exact re-prefill's (split: where exact is right)
  step s         wall time of evict + admit + question forward (2 threads, shared 2-core VM: noisy)
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import re
import statistics
import time
from pathlib import Path

import torch

import windowkit as wk
from windowkit.window import RepairRule

RULES = ["none", "sink:5", "sink:32", "head", "head+sink:5", "all"]
SYSTEM = "You are a careful assistant. Answer questions about the records the user gives, using only those records."

NAMES = ["Ada Moreno", "Jonas Berg", "Priya Nair", "Tom Weller", "Maria Okafor", "Elias Brand", "Lena Fischer",
         "Omar Haddad", "Sofia Rossi", "Kenji Sato", "Nora Lind", "Pablo Ruiz", "Ines Costa", "Ivan Petrov",
         "Mei Chen", "Aisha Bello", "Lucas Martin", "Hana Kim", "Felix Wagner", "Zara Ahmed", "Diego Lopez",
         "Anna Nowak", "Samir Khan", "Julia Weber", "Theo Dubois", "Rosa Silva", "Erik Holm", "Leila Amini"]
PLACES = ["Valdera", "Port Amsel", "Kirkby", "Linden", "Marrow", "Oakridge", "Saltmere", "Brisa", "Tolvik",
          "Halden", "Corvo", "Fenwick", "Rudna", "Estell", "Varn", "Moby"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


GOODS = ["dried figs", "olive oil", "copper wire", "raw wool", "coffee beans", "pine timber", "sea salt", "white rice",
         "green tea", "cotton bales", "roof tiles", "glass jars", "linen cloth", "cocoa", "marble slabs", "paper rolls"]


def _record(rng: random.Random, used: set) -> tuple[str, str, int]:
    """One record: (text, question, answer number). Keys carry no digits and are unique within a scenario."""
    while True:
        kind = rng.randrange(4)
        n = rng.randrange(11, 99)
        if kind == 0:
            key = rng.choice(GOODS)
            text = (f"The shipment of {key} left {rng.choice(PLACES)} on {rng.choice(DAYS)} and was stored in "
                    f"warehouse number {n}.")
            q = f"Which warehouse number was the shipment of {key} stored in?"
        elif kind == 1:
            key = rng.choice(NAMES)
            text = f"{key} checked in at the hotel on {rng.choice(DAYS)} and was given room number {n}."
            q = f"Which room number was {key} given?"
        elif kind == 2:
            key = rng.choice(PLACES)
            text = f"The water sample from the {key} well was assigned to batch number {n}."
            q = f"Which batch number was the water sample from the {key} well assigned to?"
        else:
            key = rng.choice(PLACES) + " final"
            text = f"In the {key}, played on a {rng.choice(DAYS)}, the home team scored {n} points."
            q = f"How many points did the home team score in the {key}?"
        if (kind, key) not in used:
            used.add((kind, key))
            return text, q, n


FILLER = {
    0: ["The crates were checked twice by the night crew.", "A cold wind blew across the docks all morning.",
        "The paperwork was filed in the harbour office.", "Nobody reported any damage to the cargo.",
        "The driver waited by the gate until the papers were signed.", "Gulls circled over the loading cranes.",
        "The foreman wrote the details into the ledger.", "Rain had left the yard wet and slippery."],
    1: ["The lobby smelled of coffee and fresh flowers.", "A porter carried the bags up the stairs.",
        "The receptionist smiled and handed over the key.", "The guest asked about breakfast times.",
        "Outside, a tram rattled past the old square.", "The room had a view of the river.",
        "A newspaper was left by the door each morning.", "The guest planned to stay for the whole week."],
    2: ["The technician labelled the tube with care.", "The water looked clear but smelled faintly of iron.",
        "The lab was quiet on that grey afternoon.", "Results were written into the shared notebook.",
        "The sample was kept cold until it was tested.", "A second technician checked the label.",
        "The well had been used by farmers for decades.", "The report was sent to the town council."],
    3: ["The crowd sang loudly during the second half.", "It rained briefly before the kick-off.",
        "The visiting fans travelled by coach.", "The coach praised the defence after the match.",
        "Local radio covered the game live.", "The pitch was heavy after a week of rain.",
        "The stadium lights came on at dusk.", "The captain lifted the trophy at the end."],
}


def _scenario(tok, rng: random.Random, k: int, target_tokens: int, which: int):
    """k + 1 chunks, each ONE record (a fact with a number) padded with number-free filler to ~target_tokens;
    the question ids and the expected number."""
    used: set = set()
    chunks, facts = [], []
    for i in range(k + 1):
        while True:  # kinds rotate so neighbouring chunks differ
            t, q, n = _record(rng, used)
            kind = 0 if "shipment" in t else 1 if "hotel" in t else 2 if "water sample" in t else 3
            if kind == (i + rng.randrange(2)) % 4 or rng.random() < 0.2:
                break
        fill = list(FILLER[kind])
        rng.shuffle(fill)
        sents = [t]
        while len(tok(" " + " ".join(sents), add_special_tokens=False).input_ids) < target_tokens:
            if not fill:
                fill = list(FILLER[kind])
                rng.shuffle(fill)
            sents.insert(rng.randrange(1, len(sents) + 1), fill.pop())
        chunks.append(torch.tensor(tok(" " + " ".join(sents), add_special_tokens=False).input_ids))
        facts.append((q, n))
    # which chunk the question is about: first survivor, a middle survivor, the last survivor, the new chunk
    target = [1, 1 + (k - 1) // 2, k - 1, k][which % 4]
    q, n = facts[target]
    qids = tok(f"\n\nQuestion: {q} Answer with the number only.<|im_end|>\n<|im_start|>assistant\nThe number is",
               add_special_tokens=False).input_ids
    return chunks, torch.tensor(qids), n, target


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def _number(tok, ids: list[int]):
    m = re.search(r"\d+", tok.decode(ids, skip_special_tokens=True))
    return int(m.group()) if m else None


def system_prefix(tok) -> torch.Tensor:
    """The scenarios' fixed prefix: the chat template's system turn and the opening of the user's records."""
    return torch.tensor(tok(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nRecords:",
                            add_special_tokens=False).input_ids)


def scenario_chunks(tok, rng: random.Random, k: int, target_tokens: int, s: int, tag: str):
    """Scenario ``s`` as windowkit Chunks (ids ``{tag}{s}-c{i}``), the question ids, the expected number and the
    chunk the question is about."""
    chunks, qids, answer, target = _scenario(tok, rng, k, target_tokens, s)
    return [wk.Chunk.text(c, id=f"{tag}{s}-c{i}") for i, c in enumerate(chunks)], qids, answer, target


def exact_window(backend, prefix: torch.Tensor, chunks) -> "wk.Window":
    """The reference: an exact re-prefill window of the prefix and these chunks."""
    ex = wk.Window(backend, mode="exact", prefix=prefix)
    for c in chunks:
        ex.admit(c)
    return ex


def run(setting: str, k: int, target_tokens: int, n: int, seed: int, backend, tok, rules, gen_tokens: int):
    rng = random.Random(seed)
    prefix = system_prefix(tok)
    rows = {r: {"cost": [], "kl": [], "same": [], "same_right": [], "step_s": []} for r in rules}
    exact_right = 0
    for s in range(n):
        cs, qids, answer, target = scenario_chunks(tok, rng, k, target_tokens, s, setting)
        ex = exact_window(backend, prefix, cs[1:])  # prefix + survivors + new chunk (+ the question below)
        ex_logits = ex.forward(qids)
        ex_num = _number(tok, ex.generate(qids, gen_tokens))
        right = ex_num == answer
        exact_right += right
        base = wk.Window(backend, prefix=prefix, repair="none")
        for c in cs[:k]:
            base.admit(c)
        surv = sum(len(c) for c in cs[1:k])
        denom = surv + len(cs[k]) + len(qids)
        for r in rules:
            w = base.fork()
            w.repair = RepairRule.parse(r)
            t0 = time.perf_counter()
            w.evict("head")
            w.admit(cs[k])
            logits = w.forward(qids)
            dt = time.perf_counter() - t0
            num = _number(tok, w.generate(qids, gen_tokens))
            row = rows[r]
            row["cost"].append((w.stats.repaired_tokens + len(cs[k]) + len(qids)) / denom)
            row["kl"].append(_kl(ex_logits, logits))
            row["same"].append(num == ex_num)
            if right:
                row["same_right"].append(num == ex_num)
            row["step_s"].append(dt)
        print(f"[{setting}] scenario {s + 1}/{n} (question on chunk {target}, exact {'right' if right else 'wrong'}): "
              + ", ".join(f"{r} {rows[r]['kl'][-1]:.4f}" for r in rules), flush=True)
    out = {"setting": setting, "k": k, "chunk_tokens": target_tokens, "n": n, "exact_right": exact_right, "rules": {}}
    for r in rules:
        row = rows[r]
        out["rules"][r] = {
            "cost_share": statistics.mean(row["cost"]), "mean_kl": statistics.mean(row["kl"]),
            "max_kl": max(row["kl"]), "same_number": sum(row["same"]) / n,
            "same_where_exact_right": (sum(row["same_right"]) / len(row["same_right"])) if row["same_right"] else None,
            "step_s": statistics.median(row["step_s"]),
        }
    return out


def table(results: list[dict]) -> str:
    lines = ["| rule | " + " | ".join(
        f"{r['setting']}: k={r['k']} x ~{r['chunk_tokens']} tok, N={r['n']} (exact right {r['exact_right']}/{r['n']}): "
        "cost / mean KL / same number (where exact right) / step s" for r in results) + " |",
             "|---|" + "---|" * len(results)]
    for rule in results[0]["rules"]:
        cells = []
        for r in results:
            x = r["rules"][rule]
            sr = "-" if x["same_where_exact_right"] is None else f"{100 * x['same_where_exact_right']:.0f} %"
            cells.append(f"{x['cost_share']:.2f} / {x['mean_kl']:.4f} / {100 * x['same_number']:.0f} % ({sr}) / "
                         f"{x['step_s']:.2f}")
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scenario_args(doc: str, stem: str) -> argparse.ArgumentParser:
    """The options every bench over these scenarios takes: outputs ``bench/results/<stem>.{json,md}``, the scenario
    counts of settings A and B, threads, generated tokens and the seed."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", dest="json_path", default=f"bench/results/{stem}.json")
    ap.add_argument("--md", default=f"bench/results/{stem}.md")
    ap.add_argument("--n-a", type=int, default=20, help="scenarios of setting A (k=5 x ~110 tokens)")
    ap.add_argument("--n-b", type=int, default=6, help="scenarios of setting B (k=8 x ~230 tokens)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen-tokens", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> int:
    ap = scenario_args(__doc__, "repair")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--combine", nargs="+", default=None,
                    help="only merge the JSON files of earlier runs (e.g. A and B run as two processes)")
    args = ap.parse_args(argv)
    if args.combine:
        parts = [json.loads(Path(p).read_text()) for p in args.combine]
        results = [r for part in parts for r in part["results"]]
        meta = {**parts[0]["meta"], "wall_s": sum(p["meta"]["wall_s"] for p in parts), "combined": args.combine}
        md = table(results)
        print(md)
        Path(args.json_path).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        Path(args.md).write_text(md + "\n")
        write_front(results)
        return 0
    torch.set_num_threads(args.threads)
    from windowkit.models.load import load_model
    from windowkit.models import smollm2

    rules = [RepairRule.parse(r).name for r in args.rules.split(",")]
    backend = wk.HFBackend(load_model("smollm2"))
    tok = smollm2.load_tokenizer()
    t0 = time.time()
    results = []
    if args.n_a:
        results.append(run("A", 5, 110, args.n_a, args.seed, backend, tok, rules, args.gen_tokens))
    if args.n_b:
        results.append(run("B", 8, 230, args.n_b, args.seed + 1, backend, tok, rules, args.gen_tokens))
    md = table(results)
    print(md)
    meta = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)", "threads": args.threads,
            "machine": platform.platform(), "date": time.strftime("%Y-%m-%d"), "wall_s": time.time() - t0}
    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_path).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    Path(args.md).write_text(md + "\n")
    write_front(results)
    return 0


def write_front(results, path: str = "windowkit/window/repair_front.json") -> None:
    """The measured front the Window reads for ``fidelity=<KL target>`` (setting A: k=5 sliding window)."""
    a = [r for r in results if r["setting"] == "A"]
    if not a:
        return
    a = a[0]
    front = {"source": f"bench/results/repair.json, setting A (SmolLM2-135M-Instruct, sliding window k={a['k']} x "
                       f"~{a['chunk_tokens']} tokens, N={a['n']}, look-backs); written by bench/bench_repair.py",
             "command": "PYTHONPATH=. .venv/bin/python bench/bench_repair.py",
             "rules": {k: {"cost_share": v["cost_share"], "mean_kl": v["mean_kl"]} for k, v in a["rules"].items()}}
    Path(path).write_text(json.dumps(front, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
