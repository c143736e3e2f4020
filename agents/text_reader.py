"""A text agent on real weights: read a long log through a Window of k chunks, answer a question every step.

    from agents.text_reader import TextReaderAgent, make_log
    agent = TextReaderAgent(model, tok, k=5)                 # SmolLM2-135M (windowkit.models.smollm2) or any chat LM
    log = make_log(seed=0, steps=10, k=5)                    # a generated log + one question per step
    report = agent.run(log)
    for row in report.steps: print(row.index, row.kind, row.answer, row.exact_answer, row.kl)
    print(report.summary())

Each step the window holds ``k`` log entries (one document each) behind a fixed prefix (system prompt + the user
turn's header, kept exact) and is reached with one ``win.assign(chunks)``: on a slide the oldest entry is evicted
and the newest admitted; on a look-back step an entry evicted a while ago is recalled to the tail. The question
(the user turn's end + the assistant header + the answer's lead) is read after the window and answered greedily
(a few tokens; the first number is the answer). Every step is run three ways and scored against each other:

  windowkit     ``Window(mode="patch")`` with its defaults (survivors repaired by the Window's default rule)
  exact         ``Window(mode="exact")``: the whole window re-prefilled (the reference)
  prefix cache  the previous step's exact KV reused up to the first changed entry, the rest prefilled (exact too)

logged: the three answers, next-token KL(exact || windowkit), prefill tokens (windowkit's ``stats`` delta, the
prefix cache's, the exact window's) and the measured wall time of each.

With ``engine=`` (an ``SGLangBackend`` over the same weights, e.g. ``SGLangBackend.launch_cpu``) the windowkit
column is served by a live SGLang Engine: the Window (over that backend) forms its KV as usual, each step's
window goes to the engine as a plan (``SGLangBackend.request``), the linker restores it, and SGLang prefills
only the query (and the window's last partial page) and decodes the answer. KL is then measured on the engine's
full-vocabulary log-probabilities of the first answer token, read from an untimed repeat of the step's prompt in
the plan's namespace without the plan (a radix hit on the restored pages: the same distribution, up to float
rounding of the recomputed tail); ``tokens`` counts the Window's KV work plus what
SGLang prefilled; ``engine_cached`` is what SGLang reports as cached (restored) for the request.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from policies.guess import make_guess
from windowkit.backends.hf import HFBackend
from windowkit.benchmarks import real_tasks as rt
from windowkit.benchmarks.real import Answer, TextCodec, greedy_answer, number_done, prefix_cache_tokens
from windowkit.chunk import Chunk
from windowkit.errors import ChunkError, WindowkitError
from windowkit.kv.layout import concat
from windowkit.kv.metrics import kl_divergence
from windowkit.window import Window


@dataclass
class Log:
    """A generated log: ``texts`` (one entry each) and the step plan (window contents + question per step)."""

    texts: list[str]
    plan: list[rt.StreamStep]


def make_log(seed: int = 0, steps: int = 10, k: int = 5, n_filler: int = 4, lookback_every: int = 3,
             reach: int = 2, version: int = 2) -> Log:
    """A seeded log long enough for ``steps`` slides of a ``k``-entry window, look-backs every ``lookback_every``
    (``version``: of the seeded tasks, ``windowkit.benchmarks.real_tasks``; 1 is the log before 2026-12-06)."""
    if k < 1:
        raise WindowkitError(f"k must be >= 1 entry, got {k}")
    if steps < 1:
        raise WindowkitError(f"steps must be >= 1, got {steps}")
    if lookback_every < 2:
        raise WindowkitError(f"lookback_every must be >= 2, got {lookback_every}")
    rng = random.Random(f"text-log-{seed}")
    texts, facts = rt.stream_log(rng, steps + k, n_filler, version)
    return Log(texts, rt.stream_plan(rng, facts, k, steps, lookback_every, reach))


@dataclass
class StepRow:
    index: int
    kind: str  # "slide" | "look-back"
    entries: list[int]
    question: str
    truth: str
    answer: str  # windowkit's decoded answer
    exact_answer: str
    pc_answer: str
    kl: float  # KL(exact || windowkit) of the next-token distribution after the question
    tokens: int  # windowkit's prefill tokens this step (stats delta + the question)
    pc_tokens: int  # the prefix cache's (changed entries + the question)
    exact_tokens: int  # the exact window's (the whole window + the question)
    ms: float
    exact_ms: float
    pc_ms: float
    query_ids: list[int] = field(default_factory=list)
    window_ids: list[int] = field(default_factory=list)  # prefix + entries, the exact window's token ids
    exact_logits: Optional[torch.Tensor] = None
    exact_tokens_out: list[int] = field(default_factory=list)
    engine_cached: Optional[int] = None  # with an engine: prompt tokens SGLang did not prefill (restored / cached)
    idle_ms: float = 0.0  # ``win.flush()`` after the answer: the step's store writes, between steps (not in ``ms``)
    idle_tokens: int = 0  # ``anticipate``: prefilled between steps for the next one (not in ``tokens``)

    @property
    def same_as_exact(self) -> bool:
        return rt.first_number(self.answer) == rt.first_number(self.exact_answer)

    @property
    def correct(self) -> bool:
        return rt.first_number(self.answer) == self.truth

    @property
    def exact_correct(self) -> bool:
        return rt.first_number(self.exact_answer) == self.truth


@dataclass
class TextReport:
    steps: list[StepRow] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # the windowkit window's final stats
    guess: dict = field(default_factory=dict)  # the guess policy's counters (``guess=``), else empty

    def summary(self) -> dict:
        n = len(self.steps)
        s = self.steps
        return {"steps": n, "same_as_exact": sum(r.same_as_exact for r in s),
                "accuracy": sum(r.correct for r in s) / max(n, 1),
                "exact_accuracy": sum(r.exact_correct for r in s) / max(n, 1),
                "kl_mean": sum(r.kl for r in s) / max(n, 1), "kl_max": max((r.kl for r in s), default=0.0),
                "tokens": sum(r.tokens for r in s), "pc_tokens": sum(r.pc_tokens for r in s),
                "exact_tokens": sum(r.exact_tokens for r in s),
                "ms": sum(r.ms for r in s), "exact_ms": sum(r.exact_ms for r in s), "pc_ms": sum(r.pc_ms for r in s),
                "idle_tokens": sum(r.idle_tokens for r in s), "idle_ms": sum(r.idle_ms for r in s)}


class _PrefixCache:
    """The previous step's exact window KV, reused up to the first changed chunk; the rest prefilled."""

    def __init__(self, backend: Any, prefix: Chunk):
        self.backend = backend
        self.prefix = prefix
        self.chunks: list[Chunk] = []
        self.kv = None

    def step(self, wanted: Sequence[Chunk]):
        k = 0
        while k < min(len(self.chunks), len(wanted)) and self.chunks[k].id == wanted[k].id:
            k += 1
        if self.kv is None:
            res = self.backend.forward([self.prefix] + list(wanted), 0)
            self.kv = res.kv
        else:
            keep = len(self.prefix) + sum(len(c) for c in wanted[:k])
            past = self.kv.slice(0, keep)
            rest = list(wanted[k:])
            self.kv = concat([past, self.backend.forward(rest, keep, past).kv]) if rest else past
        self.chunks = list(wanted)
        return self.kv


class TextReaderAgent:
    """Reads a log through a ``k``-entry Window and answers a question per step (see the module docstring).

    model:   a transformers causal LM with 1-D RoPE (SmolLM2-135M: ``windowkit.models.load.load_model("smollm2")``)
    tok:     its tokenizer (with a chat template)
    k:       entries held per step
    window:  extra ``Window`` arguments for the windowkit window (e.g. ``{"rank": 16}``, ``{"repair": "all"}``)
    max_new: most answer tokens decoded (decoding stops after the first number)
    anticipate: between steps (after the answer, off the timed step), prepare the entries the next step keeps:
             ``win.prefetch(next=...)`` of the next window's leading entries that are in the window now (a slide's
             survivors), their exact conditioned KV in their next places. The next step then prefills only its
             new entry (or a look-back's recalled one, which the next question asks for: not guessed) and the
             question, and its answer is exact re-prefill's. Counted apart: ``StepRow.idle_tokens``, ``idle_ms``
    guess:   instead of ``anticipate``, let a guess policy (``policies.guess``: "slide", or an instance) prepare
             the next step from the window's history alone, between steps (``pol.apply(win)``): the agent tells the
             Window nothing of its plan. A wrong guess's prefill is idle work too (``report.guess``: the counters)

        agent = TextReaderAgent(model, tok, k=5, anticipate=True)
        agent = TextReaderAgent(model, tok, k=5, guess="slide")
    """

    def __init__(self, model: Any, tok: Any, k: int = 5, window: Optional[dict] = None, max_new: int = 6,
                 threads: Optional[int] = None, engine: Any = None, anticipate: bool = False, guess: Any = None):
        if int(k) < 1:
            raise WindowkitError(f"k must be >= 1 entry, got {k}")
        if int(max_new) < 1:
            raise WindowkitError(f"max_new must be >= 1 token, got {max_new}")
        if getattr(tok, "chat_template", None) is None:
            raise WindowkitError("the tokenizer has no chat template: TextReaderAgent needs a chat model")
        if threads is not None:
            torch.set_num_threads(max(1, int(threads)))
        self.model, self.k, self.max_new = model, int(k), int(max_new)
        self.window_kwargs = dict(window or {})
        # engine: an SGLangBackend whose kv_backend runs this model; it serves the windowkit column
        self.engine = engine
        if engine is not None and getattr(getattr(engine, "kv_backend", None), "model", None) is not model:
            raise WindowkitError("engine must be an SGLangBackend whose kv_backend runs the agent's model")
        self.backend = engine.kv_backend if engine is not None else HFBackend(model)
        self.codec = TextCodec(tok)
        self.prefix = self.codec.prefix()
        self.recorder = None  # a TraceRecorder: each step's window is recorded after its answer (untimed)
        self.anticipate = bool(anticipate)
        if self.anticipate and guess is not None:
            raise WindowkitError("anticipate (the agent prepares its own next step) and guess (a policy guesses it) "
                                 "exclude each other")
        self.guess = guess

    def run(self, log: Log, on_step: Optional[Callable[[StepRow], None]] = None) -> TextReport:
        if not log.plan:
            raise WindowkitError("the log has no steps")
        need = max(max(s.chunks) for s in log.plan) + 1
        if len(log.texts) < need:
            raise WindowkitError(f"the plan reads entry {need - 1} but the log has {len(log.texts)} entries")
        for s in log.plan:
            if len(s.chunks) > self.k:
                raise WindowkitError(f"step {s.index} holds {len(s.chunks)} entries, the agent's window is k={self.k}")
        for i, t in enumerate(log.texts):
            if not t.strip():
                raise ChunkError(f"log entry {i} is empty")
        chunks = [self.codec.chunk(t, f"entry-{i}") for i, t in enumerate(log.texts)]
        win = Window(self.engine if self.engine is not None else self.backend, prefix=self.prefix,
                     **{"mode": "patch", **self.window_kwargs})
        exact = Window(self.backend, mode="exact", prefix=self.prefix)
        pc = _PrefixCache(self.backend, self.prefix)
        guesser = make_guess(self.guess)  # PolicyError (a WindowkitError) on a bad spec
        if guesser is not None:
            guesser.reset()
        stop = number_done(self.codec)
        prev: list[Chunk] = []
        report = TextReport()
        nexts = list(log.plan[1:]) + [None]
        for step, nxt in zip(log.plan, nexts):
            want = [chunks[i] for i in step.chunks]
            q = self.codec.query(step.question, step.lead)
            # windowkit
            t0 = time.perf_counter()
            p0 = win.stats.prefill_tokens
            win.assign(want)
            cached = None
            if self.engine is not None:
                assigned = time.perf_counter() - t0
                a, engine_prefill, cached = self._engine_answer(win, q, stop)
                ms = (assigned + a.seconds) * 1e3  # without the untimed repeat that reads the distribution
                tokens = win.stats.prefill_tokens - p0 + engine_prefill
            else:
                # the step's deferred work (survivor repair, the new entry's prefill) runs with the question: one forward
                a = Answer(None, win.generate(q, self.max_new, self.codec.eos, stop=stop), 0.0)
                a.logits = win.last_logits
                ms = (time.perf_counter() - t0) * 1e3
                tokens = win.stats.prefill_tokens - p0 + len(q)
            if self.recorder is not None:  # outside the timed part
                self.recorder.record(win, query_tokens=len(q))
            t0 = time.perf_counter()
            win.flush()  # between steps: the exact conditioned copies this step keeps go to the store now
            idle_tokens = 0
            if self.anticipate and nxt is not None:
                keep = []  # the next window's leading entries held now: what its step keeps of this one
                for i in nxt.chunks:
                    if chunks[i].id not in win:
                        break
                    keep.append(chunks[i].id)
                if keep:
                    idle_tokens = win.prefetch(next=keep)["prefilled"]
            elif guesser is not None:
                if nxt is None:  # after the last step: only score the last guess
                    guesser.observe(win.ids)
                else:
                    idle_tokens = guesser.apply(win)["prefilled"]
            idle_ms = (time.perf_counter() - t0) * 1e3
            # exact re-prefill
            t0 = time.perf_counter()
            exact.assign(want)
            e = greedy_answer(self.backend, exact.window_kv(), exact.next_position, q, self.max_new, self.codec.eos,
                              stop)
            exact_ms = (time.perf_counter() - t0) * 1e3
            # prefix cache
            t0 = time.perf_counter()
            kv = pc.step(want)
            p = greedy_answer(self.backend, kv, kv.num_tokens, q, self.max_new, self.codec.eos, stop)
            pc_ms = (time.perf_counter() - t0) * 1e3
            window_ids = self.prefix.input_ids.tolist() + [t for c in want for t in c.input_ids.tolist()]
            row = StepRow(step.index, step.kind, list(step.chunks), step.question, step.answer,
                          self.codec.text(a.tokens), self.codec.text(e.tokens), self.codec.text(p.tokens),
                          kl_divergence(e.logits, a.logits), tokens, prefix_cache_tokens(prev, want) + len(q),
                          len(window_ids) + len(q), ms, exact_ms, pc_ms, q.tolist(), window_ids, e.logits, e.tokens,
                          cached, idle_ms, idle_tokens)
            prev = want
            report.steps.append(row)
            if on_step is not None:
                on_step(row)
        report.stats = win.stats.as_dict()
        report.guess = dict(guesser.counters) if guesser is not None else {}
        return report

    def _engine_answer(self, win: Any, q: torch.Tensor, stop: Callable[[list[int]], bool]) -> tuple[Answer, int, int]:
        """The step's answer from the SGLang engine with the window restored from its plan: (answer with the
        first token's log-probabilities over the whole vocabulary, tokens SGLang prefilled, tokens it reports
        as cached). The window's deferred work and its question-aware repair (``Window.focus``: a probe of the
        question and the tokens it reads, within the focus budget) run on the Window's KV backend before the plan
        is built, as ``Window.generate`` runs them on transformers."""
        vocab = int(self.model.config.vocab_size)
        sp = {"max_new_tokens": self.max_new, "temperature": 0.0}
        if self.codec.eos is not None:
            sp["stop_token_ids"] = [int(self.codec.eos)]
        t0 = time.perf_counter()
        win.focus(q)
        plan, kw = self.engine.request(win, q.tolist(), sampling_params=sp)
        out = self.engine.engine.generate(**kw)
        seconds = time.perf_counter() - t0
        # the first token's distribution: the same prompt again, without the plan, in the plan's namespace: a radix
        # hit on the pages just restored (SGLang recomputes only the tail), so the same distribution, and cheaper
        # than full-vocabulary log-probabilities for every answer token
        again = self.engine.engine.generate(
            input_ids=kw["input_ids"], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            cache_salt=kw.get("cache_salt"), return_logprob=True, top_logprobs_num=vocab)
        ids = [int(t) for t in out["output_ids"]]
        tokens: list[int] = []
        for t in ids:  # the same stop rule as the local decode: up to eos, or a number followed by something
            tokens.append(t)
            if t == self.codec.eos or stop(tokens):
                break
        first = again["meta_info"]["output_top_logprobs"][0]
        if len(first) != vocab:
            raise WindowkitError(f"the engine returned {len(first)} log-probabilities, the vocabulary has {vocab}")
        lp = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        for value, token, *_ in first:
            lp[int(token)] = value
        return (Answer(lp, tokens, seconds), len(kw["input_ids"]) - plan.num_tokens,
                int(out["meta_info"].get("cached_tokens", 0)))


def format_table(report: TextReport) -> str:
    """The per-step table and the summary lines the example prints."""
    lines = ["step  kind       entries       truth  windowkit  exact  KL        tokens wk/pc/exact  ms wk/pc/exact"]
    for r in report.steps:
        lines.append(f"{r.index:>4}  {r.kind:<9}  {','.join(map(str, r.entries)):<12}  {r.truth:>5}  "
                     f"{str(rt.first_number(r.answer)):>9}  {str(rt.first_number(r.exact_answer)):>5}  {r.kl:<8.2e}  "
                     f"{r.tokens:>5}/{r.pc_tokens:>4}/{r.exact_tokens:>4}  "
                     f"{r.ms:>6.0f}/{r.pc_ms:>5.0f}/{r.exact_ms:>5.0f}")
    s = report.summary()
    n = s["steps"]
    lines += ["",
              f"steps {n} | answers equal to exact {s['same_as_exact']}/{n} | accuracy windowkit {s['accuracy']:.2f}, "
              f"exact {s['exact_accuracy']:.2f} | mean KL {s['kl_mean']:.2e} (max {s['kl_max']:.2e})",
              f"prefill tokens: windowkit {s['tokens']}, prefix cache {s['pc_tokens']} "
              f"({s['tokens'] / max(s['pc_tokens'], 1):.2f}x), exact {s['exact_tokens']} | wall time: windowkit "
              f"{s['ms'] / 1e3:.1f} s, prefix cache {s['pc_ms'] / 1e3:.1f} s, exact {s['exact_ms'] / 1e3:.1f} s"]
    if s["idle_tokens"]:
        what = "each next step guessed and prepared" if report.guess else "each next step's kept entries prepared"
        lines.append(f"between steps ({what}): {s['idle_tokens']} prefill tokens, "
                     f"{s['idle_ms'] / 1e3:.1f} s (not in the steps above)")
    if report.guess:
        g = report.guess
        lines.append(f"guesses: {g['guesses']} made, {g['prepared']} prepared, {g['hits']} right; "
                     f"{g['wasted']} tokens prefilled for wrong ones")
    cached = [r.engine_cached for r in report.steps if r.engine_cached is not None]
    if cached:
        lines.append(f"windowkit answered by the SGLang engine: {sum(cached)} prompt tokens restored from plans "
                     f"(SGLang's cached_tokens), {s['tokens']} prefilled (window KV work + SGLang's prefill)")
    return "\n".join(lines)


__all__ = ["TextReaderAgent", "TextReport", "StepRow", "Log", "make_log", "format_table"]
