"""The text agent on real weights (SmolLM2-135M): its exact window against transformers' own forward of the same
token ids, windowkit's answers against exact re-prefill, bad input raising windowkit errors; plus the pure parts
of ``windowkit bench real``. One model and one agent run for the module."""
from __future__ import annotations

import random
import re

import pytest
import torch

from agents.text_reader import Log, TextCodec, TextReaderAgent, format_table, make_log
from windowkit.models.load import load_model
from windowkit.benchmarks import real, real_tasks
from windowkit.errors import ChunkError, WindowkitError
from windowkit.kv.metrics import kl_divergence
from windowkit.models import smollm2

STEPS, K = 4, 3
# measured (2026-12-03, seed 0, k=3, 4 steps, 1 thread): windowkit's answer equals exact's on 4/4 steps (mean KL
# 5.5e-6, max 2.2e-5); exact is right on 3/4. The bound leaves one flip for a near-tie under other float rounding
MIN_SAME = STEPS - 1


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # a shared 2-core VM: one thread wastes less to contention
    return load_model("smollm2")


@pytest.fixture(scope="module")
def tok():
    return smollm2.load_tokenizer()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    return tmp_path_factory.mktemp("trace") / "text.jsonl"


@pytest.fixture(scope="module")
def report(model, tok, recorded):
    from windowkit.trace import TraceRecorder

    agent = TextReaderAgent(model, tok, k=K)
    with TraceRecorder(recorded) as agent.recorder:  # examples/text_agent.py --record
        return agent.run(make_log(seed=0, steps=STEPS, k=K, n_filler=2, lookback_every=2, reach=1))


def test_the_recorded_trace_holds_each_steps_window(report, recorded, tok) -> None:
    """Each recorded step is the window the agent answered on: its entries in order with their token counts (the
    window's ids less the fixed prefix) and the question's length; the simulator replays it."""
    from windowkit.trace import read_trace, simulate

    trace = read_trace(recorded)
    assert len(trace.steps) == len(report.steps)
    prefix = len(TextCodec(tok).prefix())  # the Window's fixed prefix: not recorded (it never moves)
    for step, row in zip(trace.steps, report.steps):
        assert [c.id for c in step.context] == [f"entry-{i}" for i in row.entries]
        assert sum(c.tokens for c in step.context) == len(row.window_ids) - prefix
        assert step.query_tokens == len(row.query_ids)
    res = simulate(trace, "cpu-tiny", ["radix", "windowkit", "floor"], progress=False)
    assert res.totals("floor")["prefill_tokens"] <= res.totals("windowkit")["prefill_tokens"] \
        <= res.totals("radix")["prefill_tokens"]


def test_exact_window_equals_transformers_forward(model, tok, report) -> None:
    assert len(report.steps) == STEPS and any(r.kind == "look-back" for r in report.steps)
    for row in report.steps:
        ids = torch.tensor(row.window_ids + row.query_ids)
        with torch.no_grad():
            ref = model(ids[None]).logits[0, -1]
            out = model.generate(ids[None], max_new_tokens=len(row.exact_tokens_out), do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        assert kl_divergence(ref, row.exact_logits) <= 1e-6
        assert out[0, len(ids):].tolist() == row.exact_tokens_out  # greedy answer = transformers' generate


def test_windowkit_agrees_with_exact(report) -> None:
    s = report.summary()
    print("\n" + format_table(report))  # pytest -s shows the measured table
    assert s["same_as_exact"] >= MIN_SAME, format_table(report)
    assert s["kl_mean"] < 0.05, format_table(report)
    for row in report.steps:  # the prefix cache is exact too
        assert real_tasks.first_number(row.pc_answer) == real_tasks.first_number(row.exact_answer)
    assert s["exact_accuracy"] >= 0.6, format_table(report)  # the task is one this small model can do
    assert s["tokens"] < s["exact_tokens"]  # windowkit prefills less than re-prefill
    assert "answers equal to exact" in format_table(report)


def test_bad_input_raises_windowkit_errors(model, tok) -> None:
    with pytest.raises(WindowkitError, match="k must be"):
        TextReaderAgent(model, tok, k=0)
    with pytest.raises(WindowkitError, match="chat template"):
        TextReaderAgent(model, type("NoChat", (), {"chat_template": None})(), k=2)
    with pytest.raises(WindowkitError, match="steps"):
        make_log(steps=0)
    agent = TextReaderAgent(model, tok, k=2)
    log = make_log(seed=1, steps=2, k=2, n_filler=1)
    with pytest.raises(WindowkitError, match="window is k=1"):
        TextReaderAgent(model, tok, k=1).run(log)
    with pytest.raises(WindowkitError, match="entries"):
        agent.run(Log(log.texts[:2], log.plan))
    with pytest.raises(ChunkError, match="empty"):
        agent.run(Log([" "] + log.texts[1:], log.plan))
    with pytest.raises(WindowkitError, match="no steps"):
        agent.run(Log(log.texts, []))


def test_bench_real_pure_parts() -> None:
    lo, hi = real.wilson(8, 10)
    assert 0.4 < lo < 0.8 < hi <= 1.0 and real.wilson(0, 0) == [0.0, 1.0]
    import random

    from windowkit.chunk import Chunk

    docs = [Chunk.text(torch.arange(i * 10 + 1, i * 10 + 5), id=f"d{i}") for i in range(4)]
    spare = Chunk.text(torch.tensor([99, 98]), id="e")
    for name in real.HISTORIES:  # every history ends on the item's documents in order
        h = real.make_history(name, docs, spare)
        ids = [c.id for c in h.before]
        for op in h.ops:
            if op[0] == "admit":
                ids.insert(len(ids) if op[2] is None else op[2], op[1].id)
            elif op[0] == "evict":
                ids.pop(0)
            elif op[0] == "recall":
                ids.append(op[1])
            else:
                ids = list(op[1])
        assert ids == [c.id for c in docs], name
    assert real.prefix_cache_tokens(docs[:3], docs) == 4 and real.prefix_cache_tokens([spare] + docs, docs) == 16
    item = real_tasks.two_doc_item(random.Random(0), 4)
    assert len(item.fact_docs) == 2 and item.answer in item.docs[item.fact_docs[1]] + item.docs[item.fact_docs[0]]
    from windowkit.cli import main

    assert main(["bench", "real", "--tasks", "nope"]) == 1  # a windowkit error, before any model loads
    with pytest.raises(SystemExit):
        main(["bench", "real", "--k", "1"])


def test_the_paired_accuracy_interval_covers_the_true_difference_95_percent_of_the_time() -> None:
    """``paired_delta`` (the "accuracy - exact" column): over 2,000 simulated paired runs of n = 200 items whose true
    difference is known (4 points lost on net, 7 % of items discordant), the interval holds the truth on about 95 %
    of them; an interval that ignored the pairing (two independent Wilson intervals) would be far wider, and one
    that conditioned on the discordant count (a Wilson interval of gained / (lost + gained), scaled) covers ~83 %."""
    import random

    from windowkit.kv.metrics import paired_delta

    rng = random.Random(0)
    n, p_lost, p_gained = 200, 0.055, 0.015  # true difference: -4.0 points
    truth, hits, widths = p_gained - p_lost, 0, []
    for _ in range(2000):
        lost = gained = 0
        for _ in range(n):
            u = rng.random()
            lost += u < p_lost
            gained += p_lost <= u < p_lost + p_gained
        d, (lo, hi) = paired_delta(lost, gained, n)
        assert lo <= d <= hi and d == (gained - lost) / n
        hits += lo <= truth <= hi
        widths.append(hi - lo)
    assert 0.92 <= hits / 2000 <= 0.98, hits / 2000
    assert sum(widths) / len(widths) < 0.1  # ~0.076; unpaired (two independent intervals at ~60 % accuracy): ~0.19
    d, (lo, hi) = paired_delta(0, 0, 50)  # no discordant item in 50: still not proof of no difference
    assert d == 0.0 and -0.1 < lo < 0 < hi < 0.1
    with pytest.raises(WindowkitError, match="do not fit"):
        paired_delta(3, 2, 4)
    # the bench table shows it: 1 of 4 exact-right answers lost, none gained
    rows = [{"kl": 0.0, "agree": i != 0, "correct": i != 0, "exact_correct": True, "tokens": 5, "forwards": 1,
             "seconds": 1.0, "prefix_cache_tokens": 10, "exact_tokens": 12} for i in range(4)]
    r = real.summarize(rows)
    assert (r["lost"], r["gained"], r["accuracy_minus_exact"]) == (1, 0, -0.25)
    assert real.delta_cell(r).startswith("-25.0 [") and real.delta_cell(r).endswith("(1 / 0)")


def _fake_result(lo: int, hi: int, n: int = 4, **meta) -> dict:
    """A result of ``real.run`` shape for items lo..hi-1: one retrieval row per item (history i mod 5)."""
    raw: dict = {}
    for i in range(lo, hi):
        row = {"kl": 0.01 * i, "agree": i % 2 == 0, "correct": True, "exact_correct": True, "tokens": 10 + i,
               "forwards": 1, "seconds": 1.0, "text": str(i), "prefix_cache_tokens": 20, "exact_tokens": 40}
        raw.setdefault("retrieval", {}).setdefault(real.HISTORIES[i % 5], []).append({"exact": dict(row, kl=0.0),
                                                                                     "keep": row})
    m = {"model": "m", "n": n, "seed": 0, "k": 4, "n_filler": 4, "stream_steps_per_log": 8, "strategies": {},
         "histories": list(real.HISTORIES), "tasks": ["retrieval"], "rotate_histories": True, "seconds": 2.0,
         "items_done": hi - lo, "items_planned": hi - lo, "complete": True, "items": [lo, hi], "threads": 1, **meta}
    return {"meta": m, "summary": real.aggregate(raw), "pooled": real.overall(raw), "raw": raw}


def test_bench_real_shards_merge_into_the_whole_run() -> None:
    whole = _fake_result(0, 4)
    merged = real.merge([_fake_result(2, 4), _fake_result(0, 2)])  # any order of shards
    assert merged["raw"] == whole["raw"] and merged["pooled"] == whole["pooled"]
    assert merged["meta"]["complete"] and merged["meta"]["items"] == [0, 4] and merged["meta"]["seconds"] == 4.0
    assert not real.merge([_fake_result(0, 1), _fake_result(2, 4)])["meta"]["complete"]  # a gap: not the whole run
    with pytest.raises(WindowkitError, match="overlapping"):
        real.merge([_fake_result(0, 3), _fake_result(2, 4)])
    cut = _fake_result(0, 2, items=[0, 4], items_planned=4, complete=False)  # a run of 0:4 stopped after 2 items
    taken_over = real.merge([cut, _fake_result(2, 4)])  # ... and a shard that ran the rest
    assert taken_over["raw"] == whole["raw"] and taken_over["meta"]["complete"]
    assert not real.merge([cut])["meta"]["complete"]
    with pytest.raises(WindowkitError, match="seed"):
        real.merge([_fake_result(0, 2), _fake_result(2, 4, seed=1)])
    with pytest.raises(WindowkitError, match="task_version"):  # a result before versions ran version 1
        real.merge([_fake_result(0, 2), _fake_result(2, 4, task_version=2)])
    assert real.merge([_fake_result(0, 2), _fake_result(2, 4, task_version=1)])["meta"]["task_version"] == 1
    other = _fake_result(0, 4, tasks=["two-doc"])  # another task's run of the same settings joins beside it
    other["raw"] = {"two-doc": other["raw"]["retrieval"]}
    both = real.merge([whole, other])
    assert both["meta"]["tasks"] == ["retrieval", "two-doc"] and both["meta"]["complete"]
    assert set(both["summary"]) == {"retrieval", "two-doc"} and both["pooled"]["keep"]["n"] == 8
    with pytest.raises(WindowkitError, match="at least one"):
        real.merge([])
    from windowkit.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "real", "--items", "3"])
    with pytest.raises(SystemExit):
        main(["bench", "real", "--focus-budget", "most"])
    with pytest.raises(SystemExit):
        main(["bench", "real", "--tasks-version", "4"])
    assert main(["bench", "real", "--items", "5:2"]) == 1  # a windowkit error, before any model loads
    assert main(["bench", "real", "--merge", "/nonexistent.json"]) == 1


def test_bench_real_shard_runs_the_same_item_as_the_whole_range(model, tok) -> None:
    kw = dict(n=2, tasks=["retrieval"], strategies=["exact", "prefix-cache", "default"], model=model, tok=tok,
              threads=1, progress=False, rotate=True)
    whole = real.run(items=(0, 2), **kw)
    shard = real.run(items=(1, 2), **kw)
    assert list(whole["raw"]["retrieval"]) == ["admit", "slide"]  # item i runs history i mod 5 only
    assert list(shard["raw"]["retrieval"]) == ["slide"] and shard["meta"]["items"] == [1, 2]
    a, b = whole["raw"]["retrieval"]["slide"][0], shard["raw"]["retrieval"]["slide"][0]
    for s in kw["strategies"]:  # an item is its index and the seed: the same tokens, costs and answers apart
        assert (a[s]["text"], a[s]["tokens"], a[s]["prefix_cache_tokens"]) == \
               (b[s]["text"], b[s]["tokens"], b[s]["prefix_cache_tokens"]), s
    # the default rule repairs the slide's survivors below the prefix cache's price, and agrees with exact here
    assert a["default"]["tokens"] < a["prefix-cache"]["tokens"] and a["default"]["kl"] < 5e-2


def test_bench_real_ahead_prepares_each_slide_off_the_critical_path(model, tok) -> None:
    """The stream's "ahead" strategy: between steps the entries the next slide keeps are prepared (their exact
    conditioned KV, ``prefetch(next=...)``), so a slide after a slide prefills only the new entry and the
    question (the floor) and its answer is exact re-prefill's (KL ~ 0); the idle work is counted apart. The
    "default" Window's ``prefetch()`` does the same through its guess policy (``guess="slide"``) from the window's
    history once it has seen a slide; "no-guess" (``guess=None``) prepares nothing: with the same repair rule, it
    prefills the survivors' repair on those steps."""
    res = real.run(n=5, tasks=["stream"], strategies=["exact", "prefix-cache", "default", "ahead", "no-guess"],
                   model=model, tok=tok, threads=1, progress=False, k=4, stream_steps=5)
    steps = res["raw"]["stream"]["slide+look-back"]
    after_slide = [s for prev, s in zip(steps, steps[1:]) if prev["ahead"]["kind"] == s["ahead"]["kind"] == "slide"]
    assert after_slide
    for s in after_slide:
        a = s["ahead"]
        assert a["tokens"] == a["floor_tokens"] < a["prefix_cache_tokens"], (a["tokens"], a["floor_tokens"])
        assert a["kl"] < 1e-6 and a["text"] == s["exact"]["text"]
    assert all(s["ahead"]["idle_tokens"] > 0 for s in steps)
    assert all("idle_tokens" in s["no-guess"] for s in steps)  # its prefetch()'s canonicals are idle work too
    # "default": the Window's guess policy, not the log reader's rule, prepares the next step; after two slides in a
    # row it has seen the slide it repeats, and the third prefills the floor's tokens with exact re-prefill's answer
    runs = [s for a, b, s in zip(steps, steps[1:], steps[2:])
            if a["default"]["kind"] == b["default"]["kind"] == s["default"]["kind"] == "slide"]
    assert runs
    for s in runs:
        g, ng = s["default"], s["no-guess"]
        assert g["tokens"] == g["floor_tokens"] < g["prefix_cache_tokens"] and g["kl"] < 1e-6, g["tokens"]
        assert g["text"] == s["exact"]["text"] and ng["tokens"] > g["tokens"]


def test_text_agent_anticipating_prefills_only_the_new_entry(model, tok) -> None:
    """``TextReaderAgent(anticipate=True)``: after each answer the entries the next step keeps are prepared
    (``prefetch(next=...)``, their exact conditioned KV). Each step then prefills only the entries behind that
    kept run (the new entry, and a look-back's recalled one, which is not guessed) and the question, fewer than the
    prefix cache, and every answer is exact re-prefill's (KL ~ 0); the work between steps is counted apart."""
    log = make_log(seed=1, steps=5, k=3, n_filler=2, lookback_every=2, reach=1)
    report = TextReaderAgent(model, tok, k=3, anticipate=True).run(log)
    rows = report.steps
    assert [r.kind for r in rows] == ["slide", "slide", "look-back", "slide", "look-back"]
    entry = [len(TextCodec(tok).chunk(t, f"entry-{i}")) for i, t in enumerate(log.texts)]
    for prev, r in zip(rows, rows[1:]):  # the leading entries held before are kept; the rest runs with the question
        kept = next((j for j, i in enumerate(r.entries) if i not in prev.entries), len(r.entries))
        assert r.tokens == sum(entry[i] for i in r.entries[kept:]) + len(r.query_ids) <= r.pc_tokens, r.index
    assert rows[1].tokens == entry[3] + len(rows[1].query_ids) < rows[1].pc_tokens  # a slide: the floor's tokens
    assert all(r.kl < 1e-6 and r.same_as_exact for r in rows), [(r.kl, r.answer, r.exact_answer) for r in rows]
    # after a look-back the kept entries stand exactly conditioned in place already; the last step has no next
    assert [r.idle_tokens > 0 for r in rows] == [True, True, False, True, False]
    s = report.summary()
    assert s["idle_tokens"] == sum(r.idle_tokens for r in rows) and "between steps" in format_table(report)


def test_text_agent_with_a_slide_guess_prefills_only_the_new_entry_after_a_right_guess(model, tok) -> None:
    """``TextReaderAgent(guess="slide")``: the agent tells the Window nothing; a guess policy prepares, between
    steps, the survivors of the last slide repeated. After a prepared guess that the next window opens with, that
    step prefills only the entries behind the guess and the question, exactly (KL ~ 0); a wrong guess changes no
    answer. Which guesses were prepared and right is replayed here from the windows alone (the policy is pure)."""
    from policies.guess import SlideGuess

    log = make_log(seed=1, steps=7, k=3, n_filler=2, lookback_every=3, reach=1)
    report = TextReaderAgent(model, tok, k=3, guess="slide").run(log)
    rows = report.steps
    entry = [len(TextCodec(tok).chunk(t, f"entry-{i}")) for i, t in enumerate(log.texts)]

    class Ids:  # what the policy reads of a Window
        ids: list = []

        def prefetch(self, next):
            return {"prefilled": 1}

    pol, win, prepared = SlideGuess(), Ids(), []
    for r in rows[:-1]:
        win.ids = [f"entry-{i}" for i in r.entries]
        prepared.append(pol.apply(win)["guess"])
    right = [t + 1 for t, g in enumerate(prepared)
             if g and [f"entry-{i}" for i in rows[t + 1].entries[:len(g)]] == g]
    assert len(right) >= 2, prepared
    for t in right:
        r, n = rows[t], len(prepared[t - 1])
        assert r.tokens == sum(entry[i] for i in r.entries[n:]) + len(r.query_ids) <= r.pc_tokens, t
        assert r.kl < 1e-6, (t, r.kl)
    assert all(r.same_as_exact for r in rows), [(r.answer, r.exact_answer) for r in rows]
    g = report.guess
    assert g["prepared"] == sum(1 for x in prepared if x) and g["hits"] == len(right)
    assert report.summary()["idle_tokens"] == g["prefilled"] and "guesses:" in format_table(report)
    with pytest.raises(WindowkitError, match="exclude each other"):
        TextReaderAgent(model, tok, k=3, anticipate=True, guess="slide")


# ---------------------------------------------------------------------- the seeded tasks, version 2
def test_tasks_version_2_gives_every_fact_of_a_window_its_own_kind() -> None:
    rng = random.Random(3)
    texts, facts = real_tasks.stream_log(rng, 40)
    kinds = [f.kind for f in facts]
    for i in range(len(kinds) - 11):  # any 12 consecutive entries: 12 kinds
        assert len(set(kinds[i:i + 12])) == 12, kinds[i:i + 12]
    for text, f in zip(texts, facts):
        assert f.sentence in text and f.answer in f.sentence and f.key.lower() in f.question.lower()
        before = re.search(r"(\w+) " + f.answer + r"\b", f.sentence).group(1)
        assert f.lead.split()[-1] == before and f.key in f.lead  # the lead ends as the fact's words do
    plan = real_tasks.stream_plan(rng, facts, k=9, steps=20)
    for step in plan:  # the asked kind names one fact in the window, look-backs included
        window_kinds = [facts[c].kind for c in step.chunks]
        assert window_kinds.count(facts[step.target].kind) == 1
    for k in (4, 8):
        item = real_tasks.retrieval_item(random.Random(k), k)
        assert len(item.docs) == k and len(item.fact_docs) == 1
        hit = [d for d in item.docs + item.extra if item.answer in d]
        assert hit == [item.docs[item.fact_docs[0]]]  # the answer's number is in the asked document only
    two = real_tasks.two_doc_item(random.Random(5), 6)
    assert "branch" in two.question and sum(" room " in d for d in two.docs + two.extra) == 2  # the branches'
    v1 = real_tasks.stream_log(random.Random(3), 40, version=1)[1]
    assert {f.kind for f in v1} <= set(real_tasks.V1_KINDS)  # version 1: the three kinds of the older results
    with pytest.raises(WindowkitError, match="task version"):
        real_tasks.stream_log(rng, 4, version=4)
    with pytest.raises(WindowkitError, match="fact kinds"):
        real_tasks.retrieval_item(rng, 12)  # 13 documents, 12 kinds
    with pytest.raises(WindowkitError, match="unknown fact kind"):
        real_tasks.fact_of("nope", rng, set())


def _exact_answer_right(model, tok, item, max_new: int) -> bool:
    """transformers' own greedy generate over prefix + the item's documents + question and lead: right or not."""
    codec = real.TextCodec(tok)
    ids = codec.ids(codec.head) + sum((codec.ids(d + "\n\n") for d in item.docs), []) + \
        codec.query(item.question, item.lead).tolist()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    return real_tasks.first_number(tok.decode(out[0, len(ids):], skip_special_tokens=True)) == item.answer


def test_version_3_two_doc_items_are_version_2_items_in_other_words(model, tok) -> None:
    """Tasks version 3 changes only the two-document wording ("The C branch: room R.", the lead "The branch where X
    is employed, the"): the same seeded draws (people, cities, rooms, documents, order) as version 2, and exact
    re-prefill (transformers' own greedy generate) answers them right (measured: 82/100 against version 2's 70/100;
    here 10/12 and 9/12 on items 0-11)."""
    right = 0
    for i in range(12):
        v2 = real_tasks.two_doc_item(random.Random(f"0-two-doc-{i}"), 4, version=2)
        v3 = real_tasks.two_doc_item(random.Random(f"0-two-doc-{i}"), 4, version=3)
        assert (v3.answer, v3.question, v3.fact_docs) == (v2.answer, v2.question, v2.fact_docs)
        assert [d.replace(" is located in room ", ": room ") for d in v2.docs] == v3.docs
        assert v3.lead.startswith("The branch where ") and v3.lead.endswith(" is employed, the")
        right += _exact_answer_right(model, tok, v3, 20)
    assert right >= 9, right


def test_exact_re_prefill_answers_the_version_2_tasks(model, tok) -> None:
    """The issue asks for tasks the model's exact answer gets right: transformers' own greedy generate over
    prefix + documents + question, on seeded version-2 items (measured: 58/60 retrievals at k = 4, 95/96 stream
    steps at k+1 = 6, 88/96 at 9; version 1: 53 % / 59 %)."""
    right = sum(_exact_answer_right(model, tok, real_tasks.retrieval_item(random.Random(f"0-retrieval-{i}"), 4), 6)
                for i in range(6))
    assert right >= 5, right
