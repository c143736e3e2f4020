"""Generate docs/api.md: every public name of windowkit, windowkit.kv, windowkit.trace, windowkit.store and
policies (their ``__all__``), with the exact signature (``inspect``), a one-line description (the first line
of the docstring) and a call.

    PYTHONPATH=. .venv/bin/python scripts/gen_api.py            # rewrite docs/api.md
    PYTHONPATH=. .venv/bin/python scripts/gen_api.py --check    # also run every call (tiny model, temp dir)

The calls are written here, by hand, in ``EXAMPLES``; ``--check`` runs them in order, module by module, after
the module's setup (``SETUP``, shown at the top of each section), so a call that no longer works fails here.
A public name without an example is listed with "(no example yet)" and reported on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODULES = ["windowkit", "windowkit.kv", "windowkit.trace", "windowkit.store", "policies"]

# What each section's calls assume (shown in the md; run before the calls by --check).
SETUP = {
    "windowkit": """\
import torch, windowkit as wk
from windowkit.backends.tiny import build          # tiny random-weight models; or a transformers model
backend = wk.HFBackend(build("tiny-qwen2"))""",
    "windowkit.kv": """\
import torch, windowkit as wk
from windowkit.backends.tiny import build
from windowkit.kv import *
backend = wk.HFBackend(build("tiny-qwen2"))
spec = backend.rope                                         # the model's RopeSpec
a = wk.Chunk.text(torch.randint(10, 120, (64,)))
b = wk.Chunk.text(torch.randint(10, 120, (32,)))
kv_a = backend.encode(a)                                    # KV(A|∅)
canon = backend.encode(b)                                   # KV(B|∅) at position 0
cond = backend.forward([b], start=len(a), past=kv_a).kv     # KV(B|A) at offset len(a)""",
    "windowkit.trace": """\
import windowkit as wk
from windowkit.trace import *
write_trace(sliding_window(steps=20), "run.jsonl")           # a trace file to read below""",
    "windowkit.store": """\
import torch, windowkit as wk
from windowkit.backends.tiny import build
from windowkit.store import *
backend = wk.HFBackend(build("tiny-qwen2"))
a = wk.Chunk.text(torch.randint(10, 120, (64,)))
b = wk.Chunk.text(torch.randint(10, 120, (32,)))
canon = backend.encode(b)""",
    "policies": """\
import windowkit as wk
from policies import *
from windowkit.trace import ChunkRef, CostModelBackend, random_lookback
a, b, c = (ChunkRef(id=i, tokens=64, kind="image") for i in "abc")
steps = random_lookback(steps=20, ordered=False).steps      # unordered steps: a placement picks the order
win = wk.Window(CostModelBackend("cpu-tiny"))               # survivors of an eviction, for the refresh policies
win.assign([CostModelBackend.chunk(i, 64, "image") for i in ("f0", "f1", "f2")]); win.evict("head")""",
}

EXAMPLES = {
    "windowkit": {
        "Chunk": 'a = wk.Chunk.text(torch.randint(10, 120, (64,)))       # .image(ids, pixel_values=, image_grid_thw=)',
        "HFBackend": 'backend = wk.HFBackend(build("tiny-qwen2"))             # detects KV layout + RoPE, checks them',
        "SGLangBackend": 'try:   # a CUDA GPU and SGLang\'s full install; KV still comes from an HFBackend on the same weights\n'
                         '    sg = wk.SGLangBackend.launch("/models/qwen2-7b", backend, page_size=16)\n'
                         'except wk.UnsupportedModelError as e:\n    print(e)                                      '
                         '    # on a machine without a GPU (docs/backends.md)',
        "Window": 'win = wk.Window(backend, rank=32, mode="patch")\n'
                  'a_id = win.admit(wk.Chunk.text(torch.randint(10, 120, (64,))))\n'
                  'win.admit(wk.Chunk.text(torch.randint(10, 120, (32,))))\n'
                  'win.evict("head"); win.recall(a_id)\n'
                  'logits = win.forward(torch.tensor([5, 6, 7]))',
        "WindowConfig": 'cfg = wk.WindowConfig(rank=16, fidelity="fast")          # the settings, validated once\n'
                        'win = wk.Window(backend, config=cfg)                     # = wk.Window(backend, rank=16, fidelity="fast")\n'
                        'win.config.repair_rule.name                              # "none"',
        "ChunkStore": 'store = wk.ChunkStore(budget_bytes=1 << 30)                # path="kvstore" adds the disk tier\n'
                      'win = wk.Window(backend, store=store)',
        "WindowkitError": 'try:\n    wk.Window(backend, mode="fast")\nexcept wk.WindowkitError as e:\n    print(e)',
        "UnsupportedModelError": 'from transformers import LlamaConfig, LlamaForCausalLM\n'
                                 'cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, '
                                 'num_hidden_layers=1,\n                  num_attention_heads=2, rope_parameters='
                                 '{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})\n'
                                 'try:\n    wk.HFBackend(LlamaForCausalLM(cfg))\n'
                                 'except wk.UnsupportedModelError as e:               # frequencies change with length\n'
                                 '    print(e)',
        "ChunkNotFoundError": 'try:\n    wk.Window(backend).recall("frame-9")\nexcept wk.ChunkNotFoundError as e:\n'
                              '    print(e)                                          # never admitted',
        "StoreCorruptError": 'try:\n    kv = wk.ChunkStore().get_canonical("some-key")\n'
                             'except (wk.StoreCorruptError, wk.ChunkNotFoundError) as e:   # bad checksum / absent\n'
                             '    print(e)',
        "SharedStoreError": 'try:\n    wk.ChunkStore(shared="mooncake")     # WINDOWKIT_MOONCAKE_* say where the master is\n'
                            'except wk.SharedStoreError as e:                    # e.reason: unavailable, timeout, ...\n'
                            '    print(e.reason)',
        "ModelMismatchError": 'wk.ChunkStore(path="kvstore", model_fingerprint=backend.fingerprint(), '
                              'layout=backend.layout).close()\n'
                              'try:\n    wk.ChunkStore(path="kvstore", model_fingerprint="another-model")\n'
                              'except wk.ModelMismatchError as e:                  # the disk tier is bound to one model\n'
                              '    print(e)',
        "TraceFormatError": 'from windowkit.trace import read_trace\n'
                            'try:\n    read_trace("missing.jsonl")\nexcept wk.TraceFormatError as e:\n'
                            '    print(e)                                          # names the file and line',
        "ChunkError": 'try:\n    wk.Chunk.text(torch.tensor([], dtype=torch.long))\nexcept wk.ChunkError as e:\n'
                      '    print(e)                                          # empty chunk',
        "KVShapeError": 'try:\n    wk.ChunkStore().put_canonical("key", torch.zeros(3))\n'
                        'except wk.KVShapeError as e:                        # not a ChunkKV\n    print(e)',
        "__version__": 'print(wk.__version__)',
    },
    "windowkit.kv": {
        "ChunkKV": 'print(canon.num_tokens, canon.nbytes, canon.layout.describe())\n'
                   'moved = canon.relocate(len(a), spec)                        # R(δ): keys re-rotated, values shared',
        "KVLayout": 'print(backend.layout.family, backend.layout.num_layers, backend.layout.slot_shapes)',
        "concat": 'window_kv = concat([kv_a, canon.relocate(len(a), spec)])   # window order',
        "Patch": 'patch = form_patch(cond, canon, delta=len(a), spec=spec, rank=8)\n'
                 'print(patch.rank, patch.nbytes, patch.layers)',
        "apply_patch": 'patched = apply_patch(canon, form_patch(cond, canon, len(a), spec, rank=8))   # canonical frame',
        "deficit": 'd = deficit(cond, canon, len(a), spec)                     # R(−δ)·KV(B|A) − KV(B|∅)',
        "form_orbit_patch": 'c = wk.Chunk.text(torch.randint(10, 120, (16,)))\n'
                            'conds = [backend.forward([b], start=80, past=backend.forward(order, start=0).kv).kv\n'
                            '         for order in ([a, c], [c, a])]                 # B behind either order of {A, C}\n'
                            'orbit = form_orbit_patch(conds, canon, 80, spec, rank=8)',
        "form_patch": 'patch = form_patch(cond, canon, delta=len(a), spec=spec, rank=32)',
        "form_removal_patch": 'kept = apply_patch(canon, form_patch(cond, canon, len(a), spec, rank=8))  # B as it sits\n'
                              'removal = form_removal_patch(canon, kept, 0, spec)        # A evicted: B should be KV(B|∅)',
        "orderings": 'orderings(["a", "b", "c"])                                 # all 6 orders (K <= 4)',
        "patch_from_deficit": 'patch = patch_from_deficit(deficit(cond, canon, len(a), spec), rank=8)',
        "place": 'kv_b = place(canon, len(a), spec, form_patch(cond, canon, len(a), spec, rank=32))  # no forward',
        "reconstruction_error": 'err = reconstruction_error(place(canon, len(a), spec), cond)  # blind reuse error',
        "RopeSpec": 'print(spec.rope_type, spec.pairing, spec.mrope, spec.inv_freq.shape)',
        "relocate_keys": 'keys = canon.layers[0][0]                                  # [heads, tokens, head_dim]\n'
                         'k_at_64 = relocate_keys(keys, 64, spec)',
        "truncated_svd": 't = truncated_svd(torch.randn(64, 256), rank=8)\nprint(t.tail_energy / t.total_energy)',
        "eta": 'eta(kl_blind=0.4, kl_arm=0.05)                               # 0.875 of the gap closed',
        "kl_divergence": 'kl_divergence(torch.randn(200), torch.randn(200))            # nats',
    },
    "windowkit.trace": {
        "ChunkRef": 'ref = ChunkRef(id="frame-12", tokens=64, kind="image")',
        "Step": 'st = Step(step=0, context=[ChunkRef(id="frame-12", tokens=64, kind="image"),\n'
                '                           ChunkRef(id="q", tokens=20)], query_tokens=24)',
        "Trace": 't = Trace([Step(step=0, context=[{"id": "a", "tokens": 4, "kind": "image"}])], name="toy")\n'
                 'print(t.stats())',
        "iter_steps": 'for st in iter_steps("run.jsonl"):                           # one step at a time\n'
                      '    print(st.step, st.ids)',
        "read_trace": 'trace = read_trace("run.jsonl")',
        "write_trace": 'write_trace(sliding_window(steps=20), "run.jsonl")',
        "TraceRecorder": 'win = wk.Window(CostModelBackend("cpu-tiny"))\n'
                         'with TraceRecorder("rec.jsonl") as rec:\n'
                         '    win.assign([CostModelBackend.chunk("f0", 64, "image"), CostModelBackend.chunk("q", 8)])\n'
                         '    rec.record(win, query_tokens=4)                        # the window, in order\n'
                         'print(read_trace("rec.jsonl").steps[0].ids)                # ["f0", "q"]',
        "load_videotree": 'trace = load_videotree(tokens_per_frame=64, max_questions=5)   # the shipped VideoTree file',
        "sliding_window": 'trace = sliding_window(steps=100, k=3)',
        "grow_interleave": 'trace = grow_interleave(episodes=10)',
        "append_zoom": 'trace = append_zoom(episodes=10)',
        "random_lookback": 'trace = random_lookback(steps=100, p=0.3)',
        "GENERATORS": 'trace = GENERATORS["sliding-3"]()                            # names: ' + "see sorted(GENERATORS)",
        "CostProfile": 'p = load_profile("h100-kamera")\nprint(p.prefill_ms(1000), p.kv_bytes_per_token)',
        "load_profile": 'p = load_profile("cpu-tiny")                                  # or a JSON file path',
        "available_profiles": 'print(available_profiles())',
        "CostModelBackend": 'cb = CostModelBackend("h100-kamera")\n'
                            'win = wk.Window(cb)                                           # no tensors, modeled ms\n'
                            'win.admit(CostModelBackend.chunk("frame-0", 256, "image"))\n'
                            'print(cb.ledger.total_ms)',
        "CostLedger": 'print(cb.ledger.as_dict())                                    # cumulative modeled cost',
        "simulate": 'res = simulate(sliding_window(steps=50), "h100-kamera", strategies=["radix", "windowkit"])',
        "SimResult": 'print(res.table())\nprint(res.summary()["ratios"])                      # {"windowkit/radix": ...}',
        "StepCost": 'print(res.steps["windowkit"][0].total_ms, res.per_step("radix")[0])',
        "STRATEGIES": 'print(list(STRATEGIES))                                      # recompute, radix, blind, ...',
        "resolve_orders": 'orders = resolve_orders(read_trace("run.jsonl"))             # the order each step replays in',
    },
    "windowkit.store": {
        "context_root": 'root = context_root()',
        "context_step": 'h = context_step(context_root(), chunk_key(a.content_hash(), backend.fingerprint()))',
        "ChunkStore": 'store = ChunkStore(path="kvstore", budget_bytes=1 << 30, model_fingerprint=backend.fingerprint(),\n'
                      '                   layout=backend.layout)\n'
                      'key = store.chunk_key(b.content_hash())\n'
                      'store.put_canonical(key, canon)\nkv = store.get_canonical(key)           # bit-identical or an error',
        "ColdTierConfig": 'store.compress(key, ColdTierConfig(rank=16))                  # low-rank cold copy of a canonical',
        "StoreStats": 'print(store.stats.as_dict())',
        "chunk_key": 'key_b = chunk_key(b.content_hash(), backend.fingerprint())',
        "context_hash": 'ctx = context_hash([chunk_key(a.content_hash(), backend.fingerprint())])   # ordered',
        "conditioned_key": 'ctx = context_hash([chunk_key(a.content_hash(), backend.fingerprint())])\n'
                           'store.has_canonical(conditioned_key(key, ctx))   # the exact KV of a chunk behind ctx, kept',
        "EmbeddedBackend": 'shared = EmbeddedBackend()\n'
                           'first, second = ChunkStore(shared=shared), ChunkStore(shared=shared)   # second reads what first put',
        "StoreBackend": 'isinstance(EmbeddedBackend(), StoreBackend)      # the shared-tier protocol (MooncakeBackend: processes)',
        "orbit_context_hash": 'orbit_context_hash(["k1", "k2"]) == orbit_context_hash(["k2", "k1"])   # True',
    },
    "policies": {
        "EvictionPolicy": 'isinstance(LRU(), EvictionPolicy)                             # the base of every policy',
        "LRU": 'p = LRU(); p.insert("a", 1); p.insert("b", 1); p.touch("a"); p.victim()   # "b"',
        "FIFO": 'p = FIFO(); p.insert("a", 1); p.insert("b", 1); p.touch("a"); p.victim()  # "a"',
        "LFU": 'p = LFU(); p.insert("a", 1); p.insert("b", 1); p.touch("a"); p.victim()   # "b"',
        "SizeAware": 'p = SizeAware(); p.insert("big", 1000); p.insert("small", 10); p.victim()   # "big"',
        "EVICTION_POLICIES": 'print(sorted(EVICTION_POLICIES))                             # lru, fifo, lfu, size',
        "make_eviction_policy": 'policy = make_eviction_policy("lfu")      # ChunkStore(budget_bytes=..., policy=policy)',
        "Belady": 'p = Belady({"a": [5], "b": [1]}); p.insert("a", 1); p.insert("b", 1); p.victim()   # "a": used last',
        "PlacementPolicy": 'isinstance(make_placement("orbit"), PlacementPolicy)          # the base of every placement',
        "Listed": 'orders = Listed().resolve(steps)          # previous order if the set is unchanged, else as listed',
        "Arrival": 'Arrival().place(1, [c, a, b], prev=[a, b])                    # [a, b, c]',
        "GreedyPatchHit": 'orders = GreedyPatchHit().resolve(steps)',
        "OrbitSet": 'OrbitSet().place(0, [b, a], None)            # [b, a]; later any step holding {a, b} gets [b, a]',
        "OfflineOptimal": 'opt = OfflineOptimal(); opt.prepare(steps); orders = opt.resolve(steps)',
        "Fixed": 'fixed = Fixed(OrbitSet().resolve(steps), name="orbit")      # replay precomputed orders',
        "PatchHitCost": 'cost = PatchHitCost()                                         # unit model: missed tokens',
        "PLACEMENTS": 'print(sorted(PLACEMENTS))',
        "make_placement": 'pol = make_placement("orbit")                                 # OrbitSet()',
        "model_cost": 'total, per_step = model_cost(make_placement("arrival").resolve(steps))',
        "RefreshPolicy": 'isinstance(make_refresh("always"), RefreshPolicy)             # the base of every refresh policy',
        "Never": 'Never().apply(win)                                            # []: keep-as-is',
        "Always": 'refreshed = Always().apply(win)            # ids re-conditioned on their current context',
        "DivergenceThreshold": 'refreshed = DivergenceThreshold(0.3).apply(win)',
        "Budgeted": 'refreshed = Budgeted(2).apply(win)                            # at most 2 per step',
        "REFRESH_POLICIES": 'print(sorted(REFRESH_POLICIES))',
        "make_refresh": 'pol = make_refresh("threshold:0.5")                           # DivergenceThreshold(0.5)',
    },
}


# ====================================================================== rendering
def _annotation(a) -> str:
    if a is inspect.Parameter.empty:
        return ""
    if isinstance(a, str):
        return a[1:-1] if len(a) > 1 and a[0] == a[-1] and a[0] in "'\"" else a  # -> "Chunk" written quoted
    return inspect.formatannotation(a)


def _signature(obj, name: str, drop_self: bool = False) -> str:
    """``name(params) -> ret`` with string annotations shown unquoted and dataclass factories as ``...``."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    parts, star_done = [], False
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    for i, p in enumerate(params):
        if p.kind == p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind == p.VAR_POSITIONAL:
            star_done = True
            s = "*" + p.name
        elif p.kind == p.VAR_KEYWORD:
            s = "**" + p.name
        else:
            s = p.name
        ann = _annotation(p.annotation)
        if ann:
            s += f": {ann}"
        if p.default is not inspect.Parameter.empty:
            d = p.default
            dr = "..." if d is dataclasses.MISSING or "factory" in repr(d) else repr(d)
            s += f" = {dr}" if ann else f"={dr}"
        parts.append(s)
        if p.kind == p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind != p.POSITIONAL_ONLY):
            parts.append("/")
    ret = _annotation(sig.return_annotation)
    out = f"{name}({', '.join(parts)})"
    if ret and ret != "None":
        out += f" -> {ret}"
    return out


def _first_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    para = doc.strip().split("\n\n")[0]  # the first paragraph, joined: docstrings wrap mid-sentence
    return " ".join(para.split())


def _methods(cls) -> list[str]:
    """Public methods and properties defined on ``cls`` itself (not inherited from Exception / BaseModel)."""
    out = []
    for n, v in cls.__dict__.items():
        if n.startswith("_"):
            continue
        if isinstance(v, property):
            doc = _first_line(v.fget)
            out.append(f"- `{n}` (property)" + (f": {doc}" if doc else ""))
        elif isinstance(v, (staticmethod, classmethod)) or inspect.isfunction(v):
            f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
            sig = _signature(f, n, drop_self=not isinstance(v, staticmethod))
            tag = " (classmethod)" if isinstance(v, classmethod) else " (staticmethod)" if isinstance(v, staticmethod) else ""
            doc = _first_line(f)
            out.append(f"- `{sig}`{tag}" + (f": {doc}" if doc else ""))
    return out


# descriptions of constants and registries (no docstring of their own to take the first line from)
DESCRIPTIONS = {
    "windowkit.trace.STRATEGIES": (
        "A registry: name -> factory. `floor` (`windowkit.trace.floor.FloorStrategy`, in the default set) is the trace's lower\n"
        "bound: each chunk prefilled once, the first time its id appears, plus every step's query, the vision tower once per\n"
        "never-seen visual chunk, nothing else. With `floor` and `radix` run, `summary()` adds `\"<strategy>/floor\"` and\n"
        "`\"<strategy>/radix\"` ratios, `\"target\"` (`\"0.6x radix\"`, or `\"1.15x floor\"` where the floor is above 0.6x radix),\n"
        "`\"target_ms\"` and `\"meets_target\"` ({strategy: bool}); see [simulation.md](simulation.md), \"The floor\"."),
}


def _entry(mod: str, name: str, obj, missing: list[str]) -> list[str]:
    lines = [f"### `{mod}.{name}`", ""]
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        head, desc = f"class {name}({bases})", _first_line(obj)
    elif inspect.isclass(obj):
        head, desc = "class " + _signature(obj, name), _first_line(obj)
    elif callable(obj):
        head, desc = _signature(obj, name), _first_line(obj)
    else:
        shown = repr(sorted(obj)) if isinstance(obj, dict) else repr(obj)
        head = f"{name}: {type(obj).__name__} = {shown}" if isinstance(obj, (str, int, float)) else \
            f"{name}: {type(obj).__name__}  # keys: {shown}"
        desc = DESCRIPTIONS.get(f"{mod}.{name}") or {"__version__": "The package version."}.get(
            name, "A registry: name -> factory." if isinstance(obj, dict) else "A constant.")
    lines += ["```python", head, "```", "", desc or "-", ""]
    if inspect.isclass(obj) and not issubclass(obj, BaseException) and not hasattr(obj, "model_fields"):
        meths = _methods(obj)
        if meths:
            lines += ["Methods and properties:", "", *meths, ""]
    call = EXAMPLES.get(mod, {}).get(name)
    if call is None:
        missing.append(f"{mod}.{name}")
        lines += ["Call: (no example yet)", ""]
    else:
        lines += ["```python", call, "```", ""]
    return lines


def render() -> tuple[str, list[str]]:
    missing: list[str] = []
    out = ["# API reference", "",
           "Every public name: the `__all__` of `windowkit`, `windowkit.kv`, `windowkit.trace`, `windowkit.store` and",
           "`policies`, with its exact signature, the first line of its docstring and a call. Generated by",
           "`scripts/gen_api.py` (signatures by `inspect`); regenerate after changing a public name:",
           "", "```bash", "PYTHONPATH=. .venv/bin/python scripts/gen_api.py            # rewrites this file",
           "PYTHONPATH=. .venv/bin/python scripts/gen_api.py --check    # and runs every call below", "```", "",
           "Each section's calls assume the setup shown at its top. `tests/test_examples.py` checks that every",
           "name of every `__all__` has an entry here.", ""]
    out += ["## Contents", ""]
    for mod in MODULES:
        m = importlib.import_module(mod)
        anchor = mod.replace(".", "")
        out.append(f"* [`{mod}`](#{anchor}): " + ", ".join(f"`{n}`" for n in m.__all__))
    out.append("")
    for mod in MODULES:
        m = importlib.import_module(mod)
        out += [f"## {mod}", "", _first_line(m), "", "Setup for the calls in this section:", "", "```python",
                SETUP[mod], "```", ""]
        for name in m.__all__:
            out += _entry(mod, name, getattr(m, name), missing)
    return "\n".join(out).rstrip() + "\n", missing


# ====================================================================== checking the calls
def check() -> list[str]:
    """Run each section's setup and then every call, in a temporary folder; returns the failures."""
    import contextlib
    import io

    import torch

    torch.set_num_threads(1)
    failures = []
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="wk-api-") as tmp:
        os.chdir(tmp)
        try:
            for mod in MODULES:
                ns: dict = {}
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(SETUP[mod], f"<setup {mod}>", "exec"), ns)
                    m = importlib.import_module(mod)
                    for name in m.__all__:
                        code = EXAMPLES.get(mod, {}).get(name)
                        if code is None:
                            continue
                        buf = io.StringIO()
                        try:
                            with contextlib.redirect_stdout(buf):
                                exec(compile(code, f"<{mod}.{name}>", "exec"), ns)
                        except Exception as e:  # report every broken call, not just the first
                            failures.append(f"{mod}.{name}: {type(e).__name__}: {e}")
                            continue
                        obj = getattr(m, name)
                        if inspect.isclass(obj) and issubclass(obj, BaseException) and not buf.getvalue().strip():
                            failures.append(f"{mod}.{name}: the example raised nothing (it should print the error)")
        finally:
            os.chdir(cwd)
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="generate docs/api.md")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "api.md"))
    ap.add_argument("--check", action="store_true", help="also run every call")
    args = ap.parse_args(argv)
    text, missing = render()
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {args.out} ({text.count(chr(10) + '### ')} names)")
    for n in missing:
        print(f"no example for {n}: add one to EXAMPLES in scripts/gen_api.py", file=sys.stderr)
    if args.check:
        bad = check()
        for b in bad:
            print(f"call failed: {b}", file=sys.stderr)
        print(f"ran the calls: {len(bad)} failed")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
