"""Wall-clock agent step at k = 8 chunks of 256 tokens on SmolLM2-135M: exact re-prefill, a prefix cache, windowkit.

    PYTHONPATH=. .venv/bin/python bench/bench_agent_step.py            # 2 warm-up + 8 measured steps, ~4-6 min
    PYTHONPATH=. .venv/bin/python bench/bench_agent_step.py --profile  # also profile windowkit's balanced step

One sliding-window agent step (issue 18's target: "wall-clock agent step at least 3x faster than a prefix
cache at k = 8 chunks of 256 tokens"): a 37-token system prompt, a window of k = 8 chunks of exactly 256 tokens
(English passages of ``windowkit.models.texts``, each chunk its own header and passage order), then a ~24-token
question closing the user turn and opening the assistant turn. A step evicts the head chunk, admits a new
256-token chunk at the tail, forwards the question and takes the greedy next token. Timed per step:

  exact         transformers forward of all ids (system + 8 chunks + question), no cache: the ceiling
  prefix-cache  a real prefix cache: the previous step's KV (transformers DynamicCache) cropped to the longest
                unchanged token prefix, the rest prefilled over it. After a head eviction that prefix is the
                system prompt (+ the few header tokens the chunks share): nearly everything is prefilled again.
  wk-balanced   ``Window(backend, prefix=system_ids)`` defaults (fidelity="balanced": repair "head:128+query:96",
                form="lazy"): ``win.evict("head"); win.admit(chunk); win.forward(question)``
  wk-position   the same with repair="head:128" (the default's position rule alone, no query focus)
  wk-fast       the same with fidelity="fast" (keep-as-is: survivors only relocate)
  wk-exact      the same with fidelity="exact" (repair "all": every survivor recomputed)
  wk-ahead      wk-balanced, and between steps (after the timed step, not in it) ``win.prefetch(next=win.ids[1:])``:
                the next slide's survivors prepared, their exact conditioned KV behind the system prompt (one idle
                forward of the 7 x 256 survivor tokens). Its step then prefills the new chunk and the question only,
                exactly. The idle forward is reported apart (``idle_s``, ``idle_tokens``): it moves the prefix
                cache's work off the step, it does not remove it
  wk:RULE       the same with repair=RULE (any repair rule, e.g. wk:sink:5+query:96)

The Window defers the eviction's survivor repair and the admission's conditioned prefill to the next read, so
each windowkit step is ONE forward (repair tokens + the new chunk + the question, ``HFBackend.recompute``).

All five run in ONE process, interleaved: step s runs every strategy once (the order rotates each step), so a
load spike of the shared machine hits all of them; ratios are taken within this run (ratio of medians, and
the median of the per-step paired ratios). Every strategy holds the same window content at step s; the
reference for the greedy-token agreement and next-token KL(exact || strategy) is the exact strategy's logits of
the same step. ``--profile`` then runs extra balanced steps (outside the measured ones) under cProfile and the
torch profiler and writes ``bench/results/agent_step_profile.txt``.

Writes ``bench/results/agent_step.json`` (``--json``: machine, threads, command, per-step times) and
``bench/results/agent_step.md`` (``--md``: the summary table).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import windowkit as wk  # noqa: E402
from windowkit.models.texts import PASSAGES, QUESTIONS  # noqa: E402

SYSTEM = ("You are a careful, precise assistant. Answer the questions about the documents the user gives you below, "
          "using only the facts that those documents state.")  # 37 tokens in the chat template
STRATEGIES = ["exact", "prefix-cache", "wk-balanced", "wk-position", "wk-fast", "wk-exact", "wk-ahead"]
WINDOW_ARGS = {"wk-balanced": {"fidelity": "balanced"}, "wk-position": {"repair": "head:128"},
               "wk-fast": {"fidelity": "fast"}, "wk-exact": {"fidelity": "exact"}, "wk-ahead": {"fidelity": "balanced"}}


# ---------------------------------------------------------------------------------------------------- inputs
def make_chunks(tok, n: int, size: int, seed: int) -> list[torch.Tensor]:
    """``n`` distinct chunks of exactly ``size`` tokens: a header, then the passages in a per-chunk order."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        order = list(range(len(PASSAGES)))
        rng.shuffle(order)
        text = f"\n\nDocument {i + 1}.\n" + " ".join(PASSAGES[j] for j in order)
        ids = tok(text, add_special_tokens=False).input_ids
        while len(ids) < size:
            ids = ids + tok(" " + PASSAGES[rng.randrange(len(PASSAGES))], add_special_tokens=False).input_ids
        out.append(torch.tensor(ids[:size]))
    return out


def system_ids(tok) -> torch.Tensor:
    return torch.tensor(tok(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n",
                            add_special_tokens=False).input_ids)


def make_questions(tok) -> list[torch.Tensor]:
    return [torch.tensor(tok(f"\nQuestion: {q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids)
            for q in QUESTIONS]


# ---------------------------------------------------------------------------------------------------- strategies
class Exact:
    """Full re-prefill of the window + question every step (transformers forward of all ids, no cache)."""

    def __init__(self, model, system: torch.Tensor):
        self.model, self.system, self.window = model, system, []
        self.last_tokens = 0

    def setup(self, chunks):
        self.window = list(chunks)

    def step(self, chunk, question):
        self.window = self.window[1:] + [chunk]
        ids = torch.cat([self.system, *self.window, question])
        with torch.no_grad():
            out = self.model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
        self.last_tokens = int(ids.numel())
        return out.logits[0, -1].float()


class PrefixCache:
    """A prefix cache: keep the KV of the longest unchanged token prefix of the previous step's sequence
    (DynamicCache cropped to it), prefill the rest over it. At least one token is always prefilled."""

    def __init__(self, model, system: torch.Tensor):
        self.model, self.system = model, system
        self.window, self.prev, self.cache = [], None, None
        self.last_tokens = self.last_reused = 0

    def _run(self, ids: torch.Tensor):
        keep = 0
        if self.prev is not None:
            n = min(len(self.prev), len(ids) - 1)
            diff = (self.prev[:n] != ids[:n]).nonzero()
            keep = int(diff[0]) if diff.numel() else n
        if self.cache is None or keep == 0:
            from transformers import DynamicCache

            self.cache, keep = DynamicCache(), 0
        else:
            self.cache.crop(keep - self.cache.get_seq_length())  # negative: drop everything after the prefix
        with torch.no_grad():
            out = self.model(input_ids=ids[None, keep:], past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        self.prev = ids
        self.last_tokens, self.last_reused = int(ids.numel()) - keep, keep
        return out.logits[0, -1].float()

    def setup(self, chunks, question):
        self.window = list(chunks)
        self._run(torch.cat([self.system, *self.window, question]))

    def step(self, chunk, question):
        self.window = self.window[1:] + [chunk]
        return self._run(torch.cat([self.system, *self.window, question]))


class WindowkitStep:
    """``Window(backend, prefix=system, **window_args)``; a step is evict head + admit + forward(question)."""

    def __init__(self, backend, system: torch.Tensor, window_args: dict, tag: str, ahead: bool = False):
        self.backend, self.system, self.window_args, self.tag = backend, system, dict(window_args), tag
        self.win = None
        self.n = 0
        self.last_tokens = 0
        self.ahead = ahead  # between steps: prepare the next slide (idle, untimed by the step)

    def setup(self, chunks):
        self.win = wk.Window(self.backend, prefix=self.system, **self.window_args)
        for c in chunks:
            self.admit(c)

    def admit(self, ids: torch.Tensor):
        self.n += 1
        self.win.admit(wk.Chunk.text(ids, id=f"{self.tag}-c{self.n}"))

    def step(self, chunk, question):
        p0 = self.win.stats.prefill_tokens
        self.win.evict("head")
        self.admit(chunk)
        logits = self.win.forward(question)
        self.last_tokens = self.win.stats.prefill_tokens - p0 + int(question.numel())
        return logits

    def idle(self) -> int:
        """Between steps: the kept copies written, and with ``ahead`` the next slide prepared. Tokens prefilled."""
        self.win.flush()
        return self.win.prefetch(next=self.win.ids[1:])["prefilled"] if self.ahead else 0


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return max(float((p.exp() * (p - q)).sum()), 0.0)


def quantiles(xs: list[float]) -> dict:
    s = sorted(xs)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"median": statistics.median(s), "p25": q[0], "p75": q[2], "min": s[0], "max": s[-1]}


def run(model, tok, k: int, size: int, warmup: int, steps: int, seed: int, strategies: list[str]) -> dict:
    backend = wk.HFBackend(model)
    system = system_ids(tok)
    questions = make_questions(tok)
    chunks = make_chunks(tok, k + warmup + steps, size, seed)
    strat = {}
    for name in strategies:
        if name == "exact":
            strat[name] = Exact(model, system)
        elif name == "prefix-cache":
            strat[name] = PrefixCache(model, system)
        else:
            args = WINDOW_ARGS[name] if name in WINDOW_ARGS else {"repair": name[len("wk:"):]}
            strat[name] = WindowkitStep(backend, system, args, name, ahead=name == "wk-ahead")
    t0 = time.perf_counter()
    for name, s in strat.items():  # the initial window (not timed)
        if name == "prefix-cache":
            s.setup(chunks[:k], questions[-1])
        else:
            s.setup(chunks[:k])
    print(f"setup {time.perf_counter() - t0:.1f} s | system {len(system)} tok, {k} chunks x {size} tok, questions "
          f"{[len(q) for q in questions]} tok", flush=True)
    rows = []
    for step in range(warmup + steps):
        chunk, question = chunks[k + step], questions[step % len(questions)]
        order = strategies[step % len(strategies):] + strategies[:step % len(strategies)]
        logits, wall, cpu, tokens, faults = {}, {}, {}, {}, {}
        for name in order:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, w0 = time.process_time(), time.perf_counter()
            logits[name] = strat[name].step(chunk, question)
            wall[name], cpu[name] = time.perf_counter() - w0, time.process_time() - c0
            faults[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            tokens[name] = strat[name].last_tokens
        idle_s, idle_tokens = {}, {}
        for name in order:  # between steps (the agent's idle time): not in the step's time
            if isinstance(strat[name], WindowkitStep):
                w0 = time.perf_counter()
                idle_tokens[name] = strat[name].idle()
                idle_s[name] = time.perf_counter() - w0
        ref = logits.get("exact")
        row = {"step": step, "warmup": step < warmup, "order": order, "wall_s": wall, "cpu_s": cpu, "tokens": tokens,
               "idle_s": idle_s, "idle_tokens": idle_tokens,
               "minor_page_faults": faults,
               "load_avg_1min": os.getloadavg()[0],
               "token": {n: int(l.argmax()) for n, l in logits.items()}}
        if ref is not None:
            row["kl"] = {n: kl(ref, l) for n, l in logits.items()}
            row["agree"] = {n: int(l.argmax()) == int(ref.argmax()) for n, l in logits.items()}
        if "prefix-cache" in strat:
            row["prefix_cache_reused"] = strat["prefix-cache"].last_reused
        rows.append(row)
        print(f"step {step}{' (warm-up)' if step < warmup else ''}: "
              + "  ".join(f"{n} {wall[n]:.2f}s" + (f"/KL {row['kl'][n]:.1e}" if ref is not None else "")
                          for n in strategies) + f"  [load {row['load_avg_1min']:.1f}]", flush=True)
    meas = [r for r in rows if not r["warmup"]]
    summary = {}
    for n in strategies:
        w = [r["wall_s"][n] for r in meas]
        d = {"wall_s": quantiles(w), "cpu_s": quantiles([r["cpu_s"][n] for r in meas]),
             "tokens_forwarded": statistics.median(r["tokens"][n] for r in meas),
             "minor_page_faults": statistics.median(r["minor_page_faults"][n] for r in meas),
             "idle_s": statistics.median(r["idle_s"].get(n, 0.0) for r in meas),
             "idle_tokens": statistics.median(r["idle_tokens"].get(n, 0) for r in meas)}
        if "prefix-cache" in strategies:
            pc = [r["wall_s"]["prefix-cache"] for r in meas]
            d["speedup_vs_prefix_cache"] = statistics.median(pc) / statistics.median(w)
            d["speedup_vs_prefix_cache_paired"] = statistics.median(a / b for a, b in zip(pc, w))
        if "exact" in strategies:
            d["speedup_vs_exact"] = statistics.median(r["wall_s"]["exact"] for r in meas) / statistics.median(w)
            d["agree"] = sum(r["agree"][n] for r in meas) / len(meas)
            d["mean_kl"] = statistics.mean(r["kl"][n] for r in meas)
            d["max_kl"] = max(r["kl"][n] for r in meas)
        summary[n] = d
    return {"system_tokens": len(system), "k": k,
            "chunk_tokens": size, "question_tokens": [len(q) for q in questions],
            "window_tokens": len(system) + k * size, "warmup": warmup, "steps": steps, "seed": seed,
            "summary": summary, "rows": rows}


def markdown(res: dict, meta: dict) -> str:
    s = res["summary"]
    lines = [f"Agent step at k = {res['k']} x {res['chunk_tokens']} tokens (+ {res['system_tokens']}-token system prompt, "
             f"{min(res['question_tokens'])}-{max(res['question_tokens'])}-token question), SmolLM2-135M-Instruct fp32, "
             f"{meta['threads']} torch threads, {res['steps']} measured steps after {res['warmup']} warm-up, interleaved "
             f"({meta['date']}; load average {meta['load_avg_1min_before']:.1f} before).", "",
             "| strategy | median s / step | p25-p75 s | tokens forwarded | vs prefix cache (medians / paired) | vs exact "
             "| greedy = exact | mean KL | max KL | between steps: s / tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, d in s.items():
        w = d["wall_s"]
        pc = (f"{d['speedup_vs_prefix_cache']:.2f}x / {d['speedup_vs_prefix_cache_paired']:.2f}x"
              if "speedup_vs_prefix_cache" in d else "-")
        ex = f"{d['speedup_vs_exact']:.2f}x" if "speedup_vs_exact" in d else "-"
        agree = f"{d['agree'] * res['steps']:.0f}/{res['steps']}" if "agree" in d else "-"
        kls = (f"{d['mean_kl']:.1e}", f"{d['max_kl']:.1e}") if "mean_kl" in d else ("-", "-")
        lines.append(f"| {n} | {w['median']:.3f} | {w['p25']:.3f}-{w['p75']:.3f} | {d['tokens_forwarded']:.0f} | {pc} | "
                     f"{ex} | {agree} | {kls[0]} | {kls[1]} | "
                     + (f"{d['idle_s']:.3f} / {d['idle_tokens']:.0f} |" if d.get("idle_tokens") else "- |"))
    lines += ["", "KL = next-token KL(exact || strategy) at the question's last token; \"greedy = exact\": the greedy next "
              "token equals exact re-prefill's. Speedups: ratio of the medians / median of the per-step ratios (same "
              "step, same run). tokens forwarded: tokens run through the model per step (windowkit: repaired survivor "
              "tokens + new chunk + question). Between steps: the median idle work after the step (``win.flush()``; "
              "wk-ahead also ``win.prefetch(next=...)``), not in the step's time."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- profile
def profile(model, tok, k: int, size: int, steps: int, seed: int, path: str) -> str:
    """cProfile + torch profiler of windowkit's balanced step (fresh window, one warm-up step, then ``steps``)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile as tprofile

    backend = wk.HFBackend(model)
    system = system_ids(tok)
    questions = make_questions(tok)
    chunks = make_chunks(tok, k + 1 + 2 * steps, size, seed + 1)
    s = WindowkitStep(backend, system, WINDOW_ARGS["wk-balanced"], "prof")
    s.setup(chunks[:k])
    s.step(chunks[k], questions[0])  # warm-up
    out = io.StringIO()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for i in range(steps):
        s.step(chunks[k + 1 + i], questions[i % len(questions)])
    pr.disable()
    out.write(f"cProfile: {steps} balanced steps, {time.perf_counter() - t0:.2f} s wall, "
              f"{torch.get_num_threads()} threads\n")
    st = pstats.Stats(pr, stream=out)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(steps):
            s.step(chunks[k + 1 + steps + i], questions[i % len(questions)])
    out.write(f"\ntorch profiler: {steps} balanced steps, by self CPU time\n")
    out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    out.write("\nby op and input shapes (top 30 by self CPU time)\n")
    out.write(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(out.getvalue())
    return out.getvalue()


# ---------------------------------------------------------------------------------------------------- main
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance() -> dict:
    files = ["windowkit/window/window.py", "windowkit/backends/hf.py", "windowkit/kv/layout.py", "windowkit/kv/rope.py"]
    import transformers

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"commit": _git("rev-parse", "HEAD"), "dirty": _git("status", "--porcelain", "--", *files).splitlines(),
            "sha256": {f: hashlib.sha256((ROOT / f).read_bytes()).hexdigest()[:16] for f in files if (ROOT / f).is_file()},
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)", "dtype": "float32",
            "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_1min_before": os.getloadavg()[0],
            "command": " ".join([Path(sys.executable).name, *sys.argv])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(ROOT / "bench/results/agent_step.json"))
    ap.add_argument("--md", default=str(ROOT / "bench/results/agent_step.md"))
    ap.add_argument("--k", type=int, default=8, help="chunks in the window")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="measured steps (each runs every strategy once)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads (default: the machine's cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="also profile windowkit's balanced step")
    ap.add_argument("--profile-only", action="store_true", help="only the profile (no measured comparison)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--profile-out", default=str(ROOT / "bench/results/agent_step_profile.txt"))
    args = ap.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES and not s.startswith("wk:")]
    if bad:
        ap.error(f"unknown strategies {bad}; choose from {STRATEGIES}")
    torch.set_num_threads(args.threads)
    from windowkit.models.load import load_model
    from windowkit.models import smollm2

    model = load_model("smollm2")
    tok = smollm2.load_tokenizer()
    meta = provenance()
    t0 = time.perf_counter()
    if not args.profile_only:
        res = run(model, tok, args.k, args.chunk_tokens, args.warmup, args.steps, args.seed, strategies)
        meta["wall_s"] = time.perf_counter() - t0
        meta["load_avg_1min_after"] = os.getloadavg()[0]
        md = markdown(res, meta)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"benchmark": "agent_step", "meta": meta, **res}, indent=1) + "\n")
        Path(args.md).write_text(md + "\n")
        print()
        print(md)
        print(f"\nwrote {args.json} and {args.md} ({meta['wall_s']:.0f} s)")
    if args.profile or args.profile_only:
        text = profile(model, tok, args.k, args.chunk_tokens, args.profile_steps, args.seed, args.profile_out)
        print(text[:6000])
        print(f"wrote {args.profile_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
