"""The binding model's sliding window (issue 18's binding target): multi-hop accuracy and time, windowkit's repair
rules against exact re-prefill and a prefix cache, over several synthetic videos.

    PYTHONPATH=. .venv/bin/python bench/bench_binding_window.py                     # 5 videos x 60 steps, ~80 s
    PYTHONPATH=. .venv/bin/python bench/bench_binding_window.py --seeds 0,1 --rules default,all

Each video is the long-video example's (``agents.long_video.binding_video``: 60 frames of 7 tokens, a window of
the last 3 frames behind a BOS prefix, look-backs as ``examples/long_video_qa.py`` makes them, one scored question
per step). Per rule a ``LongVideoAgent`` runs the 60 steps with an exact re-prefill window and a prefix cache
beside it (``PrefixCache``: the unchanged leading frames kept, the rest and the question prefilled in ONE
forward). Rules: ``default`` (the Window's defaults: fidelity "balanced"), ``ahead`` (the defaults, and the agent
prepares each next slide between steps: ``LongVideoAgent(anticipate=True)``, ``win.prefetch(next=frames[1:])``,
timed with the between-steps work), ``slide`` (the defaults, and a guess policy prepares each next step between
steps from the window's history alone: ``LongVideoAgent(guess="slide")``, ``policies.guess.SlideGuess``; the agent's
plan is not read, and wrong guesses cost idle prefill), ``removal`` (``Window(removal_patches=True)``: every survivor re-conditioned by
a removal patch after an eviction), or any repair spec (``all``, ``head``, ``none``, ...). Frames are hashed
when made (as a chunk without an id is), not by whichever strategy's timed step sees them first. Accuracy and KL
are deterministic; times are the sum of the 60 timed steps (windowkit: ``assign`` + the question's forward;
prefix cache: its step), measured in the same run, step by step interleaved; the last column adds the windowkit
agent's work between steps (``win.flush()`` after each answer: the exact conditioned copies the step keeps for
later look-backs, written to the store; ``ahead``: also the next slide's preparation); the last splits off the
time outside the model's calls (``BackendStats.busy_ms``: windowkit's bookkeeping, the prefix cache's KV
slicing). Below the table, the floor: each step's one unavoidable forward (the frames never seen before and
the question, over an exact KV of the rest made untimed) against a prefix cache, step by step.

Writes ``bench/results/binding_window.json`` (``--json``) and ``bench/results/binding_window.md`` (``--md``).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._meta import short_commit, utc_stamp  # noqa: E402

from agents.long_video import (BINDING_LOOKBACK, LongVideoAgent, PrefixCache, binding_video,  # noqa: E402
                               lookback_steps, make_plan)
from windowkit import Chunk, Window  # noqa: E402
from windowkit.backends.hf import HFBackend  # noqa: E402
from windowkit.kv.metrics import kl_divergence  # noqa: E402
from windowkit.models.load import load_model  # noqa: E402

N_FRAMES, WINDOW = 60, 3


def video(seed: int) -> tuple:
    """Binding video ``seed``: (frames, ask, prefix ids, the step plan), every frame hashed when made (as a chunk
    without an id is): not in whichever timed step sees it first."""
    frames, ask, prefix = binding_video(N_FRAMES, seed)
    for f in frames:
        f.content_hash()
    plan = make_plan(len(frames), WINDOW, N_FRAMES, lookback_steps("auto", N_FRAMES, far=BINDING_LOOKBACK[0]),
                     lookback=BINDING_LOOKBACK)
    return frames, ask, prefix, plan


def run_rule(model, seed: int, rule: str) -> dict:
    frames, ask, prefix, plan = video(seed)
    agent = LongVideoAgent(model, window=WINDOW, prefix=prefix, blind=False, max_new_tokens=1,
                           anticipate=rule == "ahead", guess="slide" if rule == "slide" else None)
    if rule == "removal":  # removal patches re-condition every survivor after an eviction (one forward over them)
        agent.win = Window(agent.backend, prefix=agent.prefix, repair="none", removal_patches=True)
    elif rule not in ("default", "ahead", "slide"):
        agent.win = Window(agent.backend, prefix=agent.prefix, repair=rule)
    rep = agent.run(frames, plan, (), (), ask=ask)
    s = rep.summary()
    mh = [r for r in rep.steps if r.question_kind == "multi_hop"]
    repair = "removal_patches=True" if rule == "removal" else agent.win.repair.name
    return dict(seed=seed, rule=rule, repair=repair, multi_hop=len(mh),
                windowkit_right=sum(bool(r.correct) for r in mh), exact_right=sum(bool(r.exact_correct) for r in mh),
                answers_differ=sum(r.correct != r.exact_correct for r in mh),
                kl_mean=s["kl_mean"], kl_max=s["kl_max"], argmax_agree=s["argmax_agree"],
                windowkit_tokens=s["windowkit_prefill_tokens"], prefix_cache_tokens=s["prefix_cache_tokens"],
                windowkit_ms=s["windowkit_ms"], windowkit_idle_ms=s["windowkit_idle_ms"],
                prefix_cache_ms=s["prefix_cache_ms"],
                windowkit_model_ms=sum(r.model_ms for r in rep.steps),
                prefix_cache_model_ms=sum(r.pc_model_ms or 0.0 for r in rep.steps),
                step_ratios=[r.ms / r.pc_ms for r in rep.steps if r.pc_ms],
                fallbacks=agent.win.stats.fallbacks, prefix_plans=agent.win.stats.prefix_plans,
                guess=dict(agent.guesser.counters) if agent.guesser is not None else None)


def run_floor(model, seed: int) -> dict:
    """The floor of each step, timed against a prefix cache step by step (both with their own backend, so each pays
    its own vision runs): the one forward no method avoids (the frames never seen before and the question, over an
    exact KV of the rest of the window, made untimed as if prepared for free)."""
    frames, ask, prefix, plan = video(seed)
    pc, floor = PrefixCache(HFBackend(model)), HFBackend(model)
    head = Chunk.text(torch.tensor(prefix), id="__prefix__")
    seen: set = set()
    ratios, floor_ms, pc_ms, kl_max = [], 0.0, 0.0, 0.0
    for s in plan:
        window = [frames[i] for i in s.frames]
        q = Chunk.text(torch.as_tensor(list(ask(s).prompt)), id="__query__")
        cut = next((k for k, c in enumerate(window) if c.id not in seen), len(window))
        done = floor.forward([head] + window[:cut], 0)  # untimed: the prepared, exact KV in front of the new part
        t0 = time.perf_counter()
        got = floor.forward(window[cut:] + [q], sum(done.spans), done.kv).logits
        t_floor = time.perf_counter() - t0
        floor.forget(q)
        t0 = time.perf_counter()
        want = pc.step([head] + window, q.input_ids)
        t_pc = time.perf_counter() - t0
        kl_max = max(kl_max, kl_divergence(want, got))  # the floor computes the same answer, or it is no floor
        seen.update(c.id for c in window)
        if s.index:  # the first step has nothing to reuse for either
            ratios.append(t_floor / t_pc)
            floor_ms, pc_ms = floor_ms + t_floor * 1e3, pc_ms + t_pc * 1e3
    return dict(seed=seed, floor_ms=floor_ms, prefix_cache_ms=pc_ms, step_ratios=ratios, kl_max=kl_max)


def table(rows: list[dict], rules: list[str]) -> str:
    lines = ["| rule (repair run) | multi-hop right: windowkit / exact (of n) | accuracy delta, points | answers that "
             "differ | KL mean / max | prefill tokens vs prefix cache | time vs prefix cache (sums / median step) | "
             "with the between-steps store writes | outside the model: windowkit / prefix cache |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rule in rules:
        rs = [r for r in rows if r["rule"] == rule]
        n = sum(r["multi_hop"] for r in rs)
        wk, ex = sum(r["windowkit_right"] for r in rs), sum(r["exact_right"] for r in rs)
        kl = statistics.mean(r["kl_mean"] for r in rs)
        klmax = max(r["kl_max"] for r in rs)
        tok = sum(r["windowkit_tokens"] for r in rs) / sum(r["prefix_cache_tokens"] for r in rs)
        ms = sum(r["windowkit_ms"] for r in rs) / sum(r["prefix_cache_ms"] for r in rs)
        idle = sum(r["windowkit_ms"] + r["windowkit_idle_ms"] for r in rs) / sum(r["prefix_cache_ms"] for r in rs)
        med = statistics.median([x for r in rs for x in r["step_ratios"]])
        pc_ms = sum(r["prefix_cache_ms"] for r in rs)
        wk_out = sum(r["windowkit_ms"] - r["windowkit_model_ms"] for r in rs) / pc_ms
        pc_out = sum(r["prefix_cache_ms"] - r["prefix_cache_model_ms"] for r in rs) / pc_ms
        between = {"ahead": " + `prefetch(next=...)` between steps", "slide": " + a `slide` guess between steps"}
        label = f"{rule} (`{rs[0]['repair']}`" + between.get(rule, "") + ")"
        lines.append(f"| {label} | {wk} / {ex} (of {n}) | {100 * (wk - ex) / n:+.1f} | "
                     f"{sum(r['answers_differ'] for r in rs)} | {kl:.1e} / {klmax:.1e} | {tok:.2f}x | "
                     f"{ms:.2f}x / {med:.2f}x | {idle:.2f}x | {wk_out:.3f}x / {pc_out:.3f}x |")
    return "\n".join(lines)


def floor_line(floors: list[dict]) -> str:
    ms = sum(f["floor_ms"] for f in floors) / sum(f["prefix_cache_ms"] for f in floors)
    med = statistics.median([x for f in floors for x in f["step_ratios"]])
    return (f"Floor (the one forward a step cannot avoid: its never-seen frames and the question, over exact KV of the "
            f"rest made untimed; timed step by step against its own prefix cache run): {ms:.2f}x / {med:.2f}x the "
            "prefix cache's time (sums / median step). A method's time lies between this and 1x by how much it adds "
            "to that forward.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4", help="binding videos")
    ap.add_argument("--rules", default="default,ahead,slide,all,head,none", help="'default', 'ahead', 'slide', 'removal' or repair specs, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=str(ROOT / "bench/results/binding_window.json"))
    ap.add_argument("--md", default=str(ROOT / "bench/results/binding_window.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    model = load_model("binding")
    rows, floors, t0 = [], [], time.time()
    for seed in seeds:
        fl = run_floor(model, seed)
        floors.append(fl)
        print(f"video {seed} floor    ms {fl['floor_ms']:.0f}/{fl['prefix_cache_ms']:.0f}", flush=True)
        for rule in rules:
            r = run_rule(model, seed, rule)
            rows.append(r)
            print(f"video {seed} {rule:8s} multi-hop {r['windowkit_right']}/{r['exact_right']} of {r['multi_hop']}, "
                  f"KL {r['kl_mean']:.1e}, tokens {r['windowkit_tokens']}/{r['prefix_cache_tokens']}, "
                  f"ms {r['windowkit_ms']:.0f}/{r['prefix_cache_ms']:.0f}", flush=True)
    commit = short_commit()
    md = (f"Binding model, sliding window of {WINDOW} frames x 7 tokens, {N_FRAMES} steps per video, videos "
          f"{args.seeds}, torch threads {args.threads}, {platform.machine()} ({utc_stamp()}, "
          f"commit {commit}, {time.time() - t0:.0f} s)\n\n" + table(rows, rules) + "\n\n" + floor_line(floors) + "\n")
    Path(args.json).write_text(json.dumps(dict(command=" ".join(sys.argv), commit=commit, seeds=seeds, rules=rules,
                                               rows=rows, floor=floors), indent=1))
    Path(args.md).write_text(md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
