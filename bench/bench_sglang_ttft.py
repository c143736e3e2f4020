"""Time to first token per sliding-window step inside a live SGLang Engine on this CPU: windowkit plans vs
SGLang's own radix cache vs no cache.

    PYTHONPATH=. .venv/bin/python bench/bench_sglang_ttft.py                       # k=8 x 256, 1 warm-up + 8 steps
    PYTHONPATH=. .venv/bin/python bench/bench_sglang_ttft.py --steps 3 --k 4       # a quicker, smaller run

One real ``sglang.Engine`` (SGLang 0.5.23, CPU engine, ``torch_native`` attention, fp32, page size 16, the
windowkit linker and plugin; ``SGLangBackend.launch_cpu``) serves SmolLM2-135M-Instruct; ``HFBackend`` over the
same checkpoint folder is windowkit's KV backend. The workload is bench/bench_agent_step.py's: a 37-token system
prompt, a window of k chunks of exactly ``--chunk-tokens`` tokens, a ~24-token question closing the user turn.
A step evicts the head chunk, admits a new chunk at the tail and asks; each configuration answers with one
greedy token (``max_new_tokens=1``). Timed per step, wall clock in this process:

  sglang-radix  ``Engine.generate`` of all ids, SGLang's radix cache on: it holds the previous step's prompt, so
                it reuses the longest unchanged token prefix (after a head eviction: the system prompt and a
                few shared header tokens) and prefills the rest
  no-cache      the same request right after ``Engine.flush_cache()`` (untimed): everything prefilled
  windowkit     the whole windowkit step: ``win.evict("head"); win.admit(chunk)``, the window's KV (the Window's
                deferred survivor repair + the new chunk's conditioned prefill on ``HFBackend``, fidelity
                "balanced" by default), the plan (KV digest + safetensors payload in ``--spool``), and
                ``Engine.generate`` with the plan: the linker restores the window's whole pages into SGLang's KV
                pool and SGLang prefills only the last partial page and the question
  windowkit-tail  the same Window, but the plan holds the system prompt and the survivors only (after the
                Window's deferred repair): SGLang prefills the new chunk and the question itself, exactly,
                over the restored survivors. After the first token the Window admits the chunk and
                ``flush()``es (its conditioned prefill on HFBackend, for the next steps): timed apart as
                ``after_first_token_s`` and reported with the whole step (``step_s``)

The configurations run interleaved in every step (sglang-radix first, while the tree holds only the previous
step's prompt; then no-cache; then the windowkit ones, whose plan pages live under salts of their own), so a load spike
of the shared machine hits all three; ratios are of medians and the median of the per-step paired ratios.
Answers: the reference is no-cache (SGLang's own exact prefill); for it and for windowkit an untimed repeat of
the same request returns the first token's log-probabilities over the whole vocabulary (a radix hit on the
pages just computed / restored, so it is the same distribution), giving next-token KL(no-cache || windowkit)
and greedy agreement. sglang-radix is exact by construction (its greedy token is checked too).

``--workload stream`` (issue 15's "with answers as issue 18 requires") replaces the synthetic chunks with the text
agent's real task: a generated log (``agents.text_reader.make_log``, tasks version 2, ``--filler`` sentences per
entry: 20 gives ~250-token entries), k entries per window behind the chat prefix, one question per step with its
answer lead, a look-back (an old entry recalled to the tail) every third step. The Window is reached with
``assign`` (its planner), ``--focus`` runs ``win.focus(question)`` before the plan (the query-driven repair of
the text agent's engine path; on by default for this workload), and each answer is decoded (up to 6 tokens,
untimed: a radix hit on the step's pages) and scored: task accuracy for no-cache and windowkit, greedy agreement
and next-token KL against no-cache, and the Window's prefill tokens against a prefix cache's (the changed entries
+ the question).

Writes ``bench/results/sglang_ttft.json`` and ``bench/results/sglang_ttft.md`` and plots
``docs/img/sglang_ttft.png``.

    PYTHONPATH=. .venv/bin/python bench/bench_sglang_ttft.py --workload stream --steps 12 \
        --json bench/results/sglang_ttft_stream.json --md bench/results/sglang_ttft_stream.md \
        --plot docs/img/sglang_ttft_stream.png
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import windowkit as wk  # noqa: E402
from bench_agent_step import make_chunks, make_questions, quantiles, system_ids  # noqa: E402
from windowkit.backends.sglang.backend import plan_request, window_token_ids  # noqa: E402

CONFIGS = ["sglang-radix", "no-cache", "windowkit", "windowkit-tail"]
WK = ("windowkit", "windowkit-tail")


def logprobs(out: dict, vocab: int) -> torch.Tensor:
    """The first output token's log-probabilities over the whole vocabulary (from ``output_top_logprobs``)."""
    top = out["meta_info"]["output_top_logprobs"][0]
    if len(top) != vocab:
        raise RuntimeError(f"the engine returned {len(top)} log-probabilities, the vocabulary has {vocab}")
    lp = torch.full((vocab,), float("-inf"), dtype=torch.float64)
    for value, token, *_ in top:
        lp[int(token)] = value
    return lp


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return max(float((p.exp() * (p - q)).sum()), 0.0)


class StreamWorkload:
    """The text agent's log as the bench's steps: ids of the chat prefix, of each entry, and per step the entries
    held (window order), the question's ids (user turn end + assistant header + answer lead) and the truth."""

    def __init__(self, tok, k: int, steps: int, n_filler: int, seed: int, lookback_every: int = 3):
        from agents.text_reader import make_log
        from windowkit.benchmarks.real import TextCodec

        self.codec = TextCodec(tok)
        self.log = make_log(seed=seed, steps=steps, k=k, n_filler=n_filler, lookback_every=lookback_every)
        self.system = self.codec.prefix().input_ids
        self.entries = [self.codec.chunk(t, f"entry-{i}") for i, t in enumerate(self.log.texts)]

    def step(self, i: int):
        st = self.log.plan[i]
        return [self.entries[j] for j in st.chunks], self.codec.query(st.question, st.lead), st.answer, st.kind


def baselines(eng, ids: list, one: dict, full: dict, vocab: int, row: dict) -> torch.Tensor:
    """SGLang radix (its tree holds the previous step's prompt, and windowkit's salted pages) and no cache, timed,
    into ``row``; returns the reference: no-cache's first-token log-probabilities (untimed, a radix hit)."""
    t = time.perf_counter()
    o = eng.generate(input_ids=ids, sampling_params=one)
    row["sglang-radix"] = {"s": time.perf_counter() - t, "cached": o["meta_info"]["cached_tokens"],
                           "token": o["output_ids"][0]}
    eng.flush_cache()
    t = time.perf_counter()
    o = eng.generate(input_ids=ids, sampling_params=one)
    row["no-cache"] = {"s": time.perf_counter() - t, "cached": o["meta_info"]["cached_tokens"],
                       "token": o["output_ids"][0]}
    ref = logprobs(eng.generate(input_ids=ids, sampling_params=one, **full), vocab)
    row["reference_top"] = int(ref.argmax())
    return ref


def pc_step_tokens(prev: list, want: list) -> int:
    """Window tokens a prefix cache holding ``prev`` prefills to reach ``want`` (from the first changed entry)."""
    k = 0
    while k < min(len(prev), len(want)) and prev[k].id == want[k].id:
        k += 1
    return sum(len(c) for c in want[k:])


def run(args) -> dict:
    from windowkit.models.load import load_model
    from windowkit.backends.sglang import SGLangBackend
    from windowkit.models import smollm2

    torch.set_num_threads(args.threads)
    tok = smollm2.load_tokenizer()
    model = load_model("smollm2")
    hf = wk.HFBackend(model)
    vocab = int(model.config.vocab_size)
    stream = StreamWorkload(tok, args.k, args.warmup + args.steps + 1, args.filler, args.seed, args.lookback_every) \
        if args.workload == "stream" else None
    if stream is None:
        system = system_ids(tok)
        questions = make_questions(tok)
        chunks = make_chunks(tok, args.k + args.warmup + args.steps, args.chunk_tokens, args.seed)
    else:
        system = stream.system
    spool = tempfile.mkdtemp(prefix="wk-ttft-", dir=args.spool)
    stats_path = os.path.join(spool, "linker_stats.json")
    t0 = time.perf_counter()
    sg = SGLangBackend.launch_cpu(str(smollm2.checkpoint_dir()), hf, page_size=args.page_size, spool_dir=spool,
                                  stats_path=stats_path, log_path=os.path.join(spool, "engine.log"), device=args.device)
    start_s = time.perf_counter() - t0
    eng = sg.engine
    one = {"max_new_tokens": 1, "temperature": 0.0}
    full = {"return_logprob": True, "top_logprobs_num": vocab}

    def linker() -> dict:
        try:
            with open(stats_path) as f:
                return json.load(f)
        except OSError:
            return {}

    rows = []

    def serve(win, kv, ids_window, query):
        """The plan for ``kv`` (the first ``len(ids_window)`` prompt tokens) + ``query``; the engine's answer."""
        t = time.perf_counter()
        plan, kw = plan_request(kv, ids_window, query, page_size=sg.page_size, fingerprint=sg.fingerprint(),
                                mode="approx", spool_dir=spool, src_pairing=sg.src_pairing,
                                pool_pairing=sg.pool_pairing, sampling_params=one)
        t_plan = time.perf_counter()
        o = eng.generate(**kw)
        return plan, kw, o, t_plan - t, time.perf_counter() - t_plan

    try:
        if stream is not None:
            return {"rows": run_stream(args, stream, sg, eng, hf, vocab, spool, linker, serve, one, full),
                    "engine_start_s": start_s,
                    "entry_tokens_mean": statistics.mean(len(c) for c in stream.entries)}
        wins = {}
        for c in CONFIGS[2:]:
            if c in args.configs:
                wins[c] = wk.Window(hf, prefix=system, fidelity=args.fidelity)
                for i, ch in enumerate(chunks[:args.k]):
                    wins[c].admit(wk.Chunk.text(ch, id=f"c{i}"))
        window = list(chunks[:args.k])
        q0 = questions[0]
        ids0 = torch.cat([system, *window, q0]).tolist()
        eng.generate(input_ids=ids0, sampling_params=one)  # the radix tree holds step 0's prompt
        for win in wins.values():  # the first window through the linker (untimed)
            serve(win, win.window_kv(), window_token_ids(win), q0.tolist())
        for s in range(args.warmup + args.steps):
            chunk = chunks[args.k + s]
            q = questions[(s + 1) % len(questions)]
            window = window[1:] + [chunk]
            ids = torch.cat([system, *window, q]).tolist()
            row = {"step": s - args.warmup, "warmup": s < args.warmup, "prompt_tokens": len(ids)}
            ref = baselines(eng, ids, one, full, vocab, row)
            for c, win in wins.items():
                before = linker()
                t = time.perf_counter()
                p0 = win.stats.prefill_tokens
                win.evict("head")
                if c == "windowkit":  # the whole window from the Window: its deferred repair + the new chunk's
                    win.admit(wk.Chunk.text(chunk, id=f"c{args.k + s}"))  # conditioned prefill, on HFBackend
                    kv = win.window_kv()
                    t_kv = time.perf_counter()
                    plan, kw, o, plan_s, engine_s = serve(win, kv, window_token_ids(win), q.tolist())
                else:  # windowkit-tail: the survivors from the Window (its deferred repair), the new chunk by SGLang
                    kv = win.window_kv()
                    t_kv = time.perf_counter()
                    plan, kw, o, plan_s, engine_s = serve(win, kv, window_token_ids(win), chunk.tolist() + q.tolist())
                ttft = time.perf_counter() - t
                kv_tokens = win.stats.prefill_tokens - p0  # forwarded by the Window before the first token
                after_s = 0.0
                if c == "windowkit-tail":  # after the first token: the Window takes the new chunk (its KV for the
                    t2 = time.perf_counter()  # next steps: one conditioned prefill on HFBackend, via flush())
                    win.admit(wk.Chunk.text(chunk, id=f"c{args.k + s}"))
                    win.flush()
                    after_s = time.perf_counter() - t2
                after = linker()
                assert kw["input_ids"] == ids, "windowkit's prompt must be the same token ids"
                # untimed: the same prompt without the plan, in its namespace: a hit on the pages just computed
                lp = logprobs(eng.generate(input_ids=ids, sampling_params=one, cache_salt=kw.get("cache_salt"),
                                           **full), vocab)
                row[c] = {"s": ttft, "window_kv_s": t_kv - t, "plan_s": plan_s, "engine_s": engine_s,
                          "after_first_token_s": after_s, "step_s": ttft + after_s,
                          "cached": o["meta_info"]["cached_tokens"], "token": o["output_ids"][0],
                          "kv_prefill_tokens": kv_tokens, "after_prefill_tokens": win.stats.prefill_tokens - p0 - kv_tokens,
                          "plan_tokens": plan.num_tokens,
                          "sglang_prefill_tokens": len(ids) - plan.num_tokens,
                          "restored": after.get("tokens_restored", 0) - before.get("tokens_restored", 0),
                          "fallbacks": after.get("fallbacks", 0) - before.get("fallbacks", 0),
                          "kl": kl(ref, lp), "greedy_top": int(lp.argmax())}
                os.remove(plan.kv_ref)  # ~100 MB per step at k=8 x 256
            rows.append(row)
            print(json.dumps({k: (v if not isinstance(v, dict) else {a: (round(b, 3) if isinstance(b, float) else b)
                                                                   for a, b in v.items()}) for k, v in row.items()}),
                  flush=True)
    finally:
        sg.shutdown()
        shutil.rmtree(spool, ignore_errors=True)
    return {"rows": rows, "engine_start_s": start_s}


def run_stream(args, stream: StreamWorkload, sg, eng, hf, vocab: int, spool: str, linker, serve, one: dict,
               full: dict) -> list[dict]:
    """``run`` on the text agent's log (``--workload stream``): ``assign`` per step, answers decoded and scored."""
    from windowkit.benchmarks import real_tasks as rt

    answer = {"max_new_tokens": 6, "temperature": 0.0}
    decode = stream.codec.text
    wins = {c: wk.Window(hf, prefix=wk.Chunk.text(stream.system, id="__prefix__"), fidelity=args.fidelity)
            for c in args.configs}
    want0, q0, _, _ = stream.step(0)  # step 0 fills the window (untimed)
    eng.generate(input_ids=torch.cat([stream.system, *[c.input_ids for c in want0], q0]).tolist(),
                 sampling_params=one)
    for c, win in wins.items():
        win.assign(want0 if c == "windowkit" else want0[:-1])
        if c == "windowkit-tail":
            win.assign(want0)
        serve(win, win.window_kv(), window_token_ids(win), q0.tolist())
        win.flush()
    prev, rows = want0, []
    for s in range(args.warmup + args.steps):
        want, q, truth, kind = stream.step(s + 1)
        ids = torch.cat([stream.system, *[c.input_ids for c in want], q]).tolist()
        row = {"step": s - args.warmup, "warmup": s < args.warmup, "prompt_tokens": len(ids), "kind": kind,
               "truth": truth, "pc_tokens": pc_step_tokens(prev, want) + len(q)}
        ref = baselines(eng, ids, one, full, vocab, row)
        ref_text = decode(eng.generate(input_ids=ids, sampling_params=answer)["output_ids"])
        row["reference_answer"], row["reference_correct"] = ref_text, rt.first_number(ref_text) == truth
        for c, win in wins.items():
            before = linker()
            t = time.perf_counter()
            p0 = win.stats.prefill_tokens
            if c == "windowkit":  # the whole window from the Window (its planner, repair, the new entry's prefill)
                win.assign(want)
                if args.focus:
                    win.focus(q)
                kv = win.window_kv()
                t_kv = time.perf_counter()
                plan, kw, o, plan_s, engine_s = serve(win, kv, window_token_ids(win), q.tolist())
            else:  # windowkit-tail: the survivors from the Window, the step's last entry prefilled by SGLang
                win.assign(want[:-1])
                if args.focus:
                    win.focus(q)
                kv = win.window_kv()
                t_kv = time.perf_counter()
                plan, kw, o, plan_s, engine_s = serve(win, kv, window_token_ids(win),
                                                      want[-1].input_ids.tolist() + q.tolist())
            ttft = time.perf_counter() - t
            kv_tokens = win.stats.prefill_tokens - p0
            t2 = time.perf_counter()  # after the first token: the tail entry's KV for the next steps, store writes
            if c == "windowkit-tail":
                win.assign(want)
            win.flush()
            after_s = time.perf_counter() - t2
            after = linker()
            assert kw["input_ids"] == ids, "windowkit's prompt must be the same token ids"
            salt = kw.get("cache_salt")  # untimed repeats in the plan's namespace: hits on the pages just restored
            lp = logprobs(eng.generate(input_ids=ids, sampling_params=one, cache_salt=salt, **full), vocab)
            text = decode(eng.generate(input_ids=ids, sampling_params=answer, cache_salt=salt)["output_ids"])
            # tokens the windowkit step prefilled: the Window's (before and after the first token) + SGLang's
            tokens = win.stats.prefill_tokens - p0 + len(ids) - plan.num_tokens
            row[c] = {"s": ttft, "window_kv_s": t_kv - t, "plan_s": plan_s, "engine_s": engine_s,
                      "after_first_token_s": after_s, "step_s": ttft + after_s,
                      "cached": o["meta_info"]["cached_tokens"], "token": o["output_ids"][0],
                      "kv_prefill_tokens": kv_tokens, "after_prefill_tokens": win.stats.prefill_tokens - p0 - kv_tokens,
                      "plan_tokens": plan.num_tokens, "sglang_prefill_tokens": len(ids) - plan.num_tokens,
                      "prefill_tokens": tokens,
                      "restored": after.get("tokens_restored", 0) - before.get("tokens_restored", 0),
                      "fallbacks": after.get("fallbacks", 0) - before.get("fallbacks", 0),
                      "kl": kl(ref, lp), "greedy_top": int(lp.argmax()), "answer": text,
                      "correct": rt.first_number(text) == truth}
            os.remove(plan.kv_ref)
        prev = want
        rows.append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {a: (round(b, 3) if isinstance(b, float) else b)
                                                               for a, b in v.items()}) for k, v in row.items()}),
              flush=True)
    return rows


def summarize(rows: list[dict], configs: list[str]) -> dict:
    meas = [r for r in rows if not r["warmup"]]
    out = {}
    for c in configs:
        xs = [r[c]["s"] for r in meas]
        out[c] = {**quantiles(xs), "cached_tokens_median": statistics.median(r[c]["cached"] for r in meas),
                  "greedy_equal_no_cache": sum(r[c]["token"] == r["no-cache"]["token"] for r in meas)}
    radix = out["sglang-radix"]["median"]
    for c in configs:
        out[c]["vs_radix_medians"] = out[c]["median"] / radix
        out[c]["vs_radix_paired"] = statistics.median(r[c]["s"] / r["sglang-radix"]["s"] for r in meas)
    for c in (x for x in WK if x in configs):
        w = [r[c] for r in meas]
        out[c].update({
            "window_kv_s_median": statistics.median(x["window_kv_s"] for x in w),
            "plan_s_median": statistics.median(x["plan_s"] for x in w),
            "engine_s_median": statistics.median(x["engine_s"] for x in w),
            "after_first_token_s_median": statistics.median(x["after_first_token_s"] for x in w),
            "step_s_median": statistics.median(x["step_s"] for x in w),
            "step_vs_radix_medians": statistics.median(x["step_s"] for x in w) / radix,
            "kv_prefill_tokens_median": statistics.median(x["kv_prefill_tokens"] for x in w),
            "sglang_prefill_tokens_median": statistics.median(x["sglang_prefill_tokens"] for x in w),
            "restored_tokens_median": statistics.median(x["restored"] for x in w),
            "fallbacks": sum(x["fallbacks"] for x in w),
            "kl_mean": sum(x["kl"] for x in w) / len(w), "kl_max": max(x["kl"] for x in w),
            "greedy_equal_reference": sum(x["greedy_top"] == r["reference_top"] for x, r in zip(w, meas))})
        if "correct" in w[0]:  # the stream workload: answers scored, tokens against a prefix cache's
            out[c].update({"accuracy": sum(x["correct"] for x in w) / len(w),
                           "reference_accuracy": sum(r["reference_correct"] for r in meas) / len(meas),
                           "answers_equal_reference": sum(rt_number(x["answer"]) == rt_number(r["reference_answer"])
                                                          for x, r in zip(w, meas)),
                           "tokens_vs_prefix_cache": sum(x["prefill_tokens"] for x in w) / sum(r["pc_tokens"]
                                                                                                for r in meas)})
    return out


def rt_number(text: str):
    from windowkit.benchmarks.real_tasks import first_number

    return first_number(text)


def markdown(res: dict) -> str:
    a, s = res["args"], res["summary"]
    configs = [c for c in CONFIGS if c in s]
    n = len([r for r in res["rows"] if not r["warmup"]])
    what = (f"k = {a['k']} x {a['chunk_tokens']} tokens" if a.get("workload", "synthetic") == "synthetic" else
            f"the text agent's log (tasks version 2, {a['filler']} filler sentences: k = {a['k']} entries of "
            f"~{res.get('entry_tokens_mean', 0):.0f} tokens, "
            + (f"a look-back every {a['lookback_every']} steps" if a['lookback_every'] <= a['steps'] + a['warmup']
               else "slides only") + f", focus {a['focus']})")
    lines = [f"Time to first token per sliding-window step, SGLang {res['sglang']} Engine on {a['device']}, "
             f"SmolLM2-135M-Instruct fp32, {what} (+ system prompt, question; "
             f"{res['rows'][-1]['prompt_tokens']} prompt tokens), page {a['page_size']}, Window fidelity "
             f"{a['fidelity']}, {n} measured steps after {a['warmup']} warm-up, interleaved ({res['date']}; load "
             f"average {res['load_before']} before, {res['load_after']} after, on {res['machine']['cores']} cores "
             f"shared with the engine and with other jobs).", "",
             "| configuration | median TTFT s | p25-p75 s | vs radix (medians / paired) | cached tokens (median) | "
             "greedy = no-cache |", "|---|---:|---:|---:|---:|---:|"]
    for c in configs:
        x = s[c]
        lines.append(f"| {c} | {x['median']:.3f} | {x['p25']:.3f}-{x['p75']:.3f} | {x['vs_radix_medians']:.2f}x / "
                     f"{x['vs_radix_paired']:.2f}x | {x['cached_tokens_median']:.0f} | {x['greedy_equal_no_cache']}/{n} |")
    lines.append("")
    for c in (x for x in WK if x in configs):
        w = s[c]
        lines.append(
            f"* {c}: TTFT = window KV on HFBackend {w['window_kv_s_median']:.3f} s ({w['kv_prefill_tokens_median']:.0f} "
            f"tokens forwarded by the Window) + plan {w['plan_s_median']:.3f} s (KV digest, payload file) + engine "
            f"{w['engine_s_median']:.3f} s (restore {w['restored_tokens_median']:.0f} tokens, prefill "
            f"{w['sglang_prefill_tokens_median']:.0f}); after the first token {w['after_first_token_s_median']:.3f} s "
            f"(whole step {w['step_s_median']:.3f} s = {w['step_vs_radix_medians']:.2f}x radix's TTFT); next-token "
            f"KL(no-cache || {c}) mean {w['kl_mean']:.2e}, max {w['kl_max']:.2e}; greedy token = no-cache's "
            f"{w['greedy_equal_reference']}/{n}; linker fallbacks {w['fallbacks']}."
            + (f" Answers: accuracy {w['accuracy']:.2f} (no-cache {w['reference_accuracy']:.2f}), the same number as "
               f"no-cache's on {w['answers_equal_reference']}/{n} steps; prefill tokens (the Window's + SGLang's) "
               f"{w['tokens_vs_prefix_cache']:.2f}x a prefix cache's." if "accuracy" in w else ""))
    best = min((s[c]["vs_radix_medians"], c) for c in WK if c in configs)
    lines += ["", f"Target (issue 15): windowkit <= 0.5x SGLang radix at k = 8 x 256. Here: best {best[1]} "
              f"{best[0]:.2f}x ({'met' if best[0] <= 0.5 else 'NOT met'})."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    configs = [c for c in CONFIGS if c in s]
    meas = [r for r in res["rows"] if not r["warmup"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1.2]})
    colors = {"sglang-radix": "tab:blue", "no-cache": "tab:gray", "windowkit": "tab:red", "windowkit-tail": "tab:orange"}
    for c in configs:
        ax.plot([r["step"] for r in meas], [r[c]["s"] for r in meas], "o-", color=colors[c], label=c)
    ax.set_xlabel("step (evict head, admit a chunk, ask)")
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    a = res["args"]
    size = (f"{a['chunk_tokens']} tokens" if a.get("workload", "synthetic") == "synthetic" else
            f"~{res.get('entry_tokens_mean', 0):.0f}-token log entries, real answers")
    ax.set_title(f"SGLang Engine on {a['device']}, SmolLM2-135M, k={a['k']} x {size}, "
                 f"load avg {res['load_before']}", fontsize=10)
    med = [s[c]["median"] for c in configs]
    bx.bar(range(len(configs)), med, color=[colors[c] for c in configs])
    bx.set_xticks(range(len(configs)), [f"{c}\n{s[c]['vs_radix_medians']:.2f}x radix" for c in configs], fontsize=7)
    bx.axhline(0.5 * s["sglang-radix"]["median"], color="k", ls=":", lw=1, label="target: 0.5x radix")
    bx.set_ylabel("median TTFT (s)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of this process (windowkit's KV work); 1: on 2 cores shared with the engine "
                         "and other jobs, 2 threads made the Window's forwards ~5x slower (measured, docs/backends.md)")
    ap.add_argument("--configs", default="windowkit,windowkit-tail",
                    help="windowkit configurations to run beside sglang-radix and no-cache (comma-separated)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the Engine runs (cuda: scripts/gpu_check.sh); windowkit's KV work stays on the CPU")
    ap.add_argument("--fidelity", default="balanced", help="the Window's fidelity (balanced | fast | exact | a KL)")
    ap.add_argument("--workload", choices=("synthetic", "stream"), default="synthetic",
                    help="synthetic: bench_agent_step's chunks; stream: the text agent's log, answers scored")
    ap.add_argument("--filler", type=int, default=20, help="stream: filler sentences per log entry (20: ~250 tokens)")
    ap.add_argument("--lookback-every", type=int, default=3,
                    help="stream: a look-back every this many steps (more than --steps: slides only)")
    ap.add_argument("--focus", action=argparse.BooleanOptionalAction, default=None,
                    help="win.focus(question) before the plan (default: on for --workload stream, off for synthetic)")
    ap.add_argument("--spool", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where plan payloads go (tmpfs by default)")
    ap.add_argument("--json", default=str(ROOT / "bench/results/sglang_ttft.json"))
    ap.add_argument("--md", default=str(ROOT / "bench/results/sglang_ttft.md"))
    ap.add_argument("--plot", default=str(ROOT / "docs/img/sglang_ttft.png"))
    args = ap.parse_args(argv)
    if min(args.k, args.chunk_tokens, args.steps, args.page_size, args.threads) < 1 or args.warmup < 0:
        ap.error("--k, --chunk-tokens, --steps, --page-size and --threads must be >= 1, --warmup >= 0")
    args.configs = [c for c in args.configs.split(",") if c]
    if args.focus is None:
        args.focus = args.workload == "stream"
    if args.focus and args.workload == "synthetic":
        ap.error("--focus is for --workload stream (the synthetic workload's results are without it)")
    if not args.configs or any(c not in WK for c in args.configs):
        ap.error(f"--configs must name some of {', '.join(WK)}")
    import sglang

    load_before = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()
    out = run(args)
    res = {"what": "time to first token per sliding-window step: windowkit plans vs SGLang radix vs no cache",
           "command": "PYTHONPATH=. .venv/bin/python bench/bench_sglang_ttft.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "args": vars(args), "sglang": sglang.__version__, "torch": torch.__version__,
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load_before,
           "load_after": round(os.getloadavg()[0], 2), "wall_s": round(time.perf_counter() - t0, 1),
           "engine_start_s": round(out["engine_start_s"], 1), "rows": out["rows"]}
    if args.workload == "stream":
        res["entry_tokens_mean"] = out.get("entry_tokens_mean")
    res["summary"] = summarize(out["rows"], ["sglang-radix", "no-cache"] + args.configs)
    for p in (args.json, args.md, args.plot):
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(args.md, "w") as f:
        f.write(md)
    plot(res, args.plot)
    print(md)
    print(f"wrote {args.json}, {args.md}, {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
