"""Generate docs/api.md from the public surface: the top level (``windowkit.__all__``), each subpackage's
``__all__`` (``MODULES``) and ``policies``' ``__all__``, each name with its exact signature (``inspect``), a
one-line description (the first paragraph of its docstring) and a call.

The surface is meant to fit in one's head: the top level plus at most ``SUBPACKAGE_LIMIT`` (40) names in the
subpackages and ``policies``. A subpackage name that is also a top-level name (``windowkit.store.ChunkStore`` is
``windowkit.ChunkStore``) is documented once, under ``windowkit``, and not counted (``public_names``). Every
other name stays importable from its module (``from windowkit.window.plan import StepChoice``) and from a
subpackage that imports it, but is not documented here. tests/test_api_surface.py checks the limit, the
docstrings, that every subpackage with public names is in ``MODULES`` and that docs/api.md is what this
script writes.

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
import re
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODULES = ["windowkit", "windowkit.window", "windowkit.backends", "windowkit.backends.sglang", "windowkit.kv",
           "windowkit.store", "windowkit.graph", "windowkit.trace", "policies"]
SUBPACKAGE_LIMIT = 40  # documented names outside the top level (issue 17: "at most about 40")

# What each section's calls assume (shown in the md; run before the calls by --check).
SETUP = {
    "windowkit": """\
import torch, windowkit as wk
from windowkit.backends.tiny import build          # tiny random-weight models; or a transformers model
backend = wk.HFBackend(build("tiny-qwen2"))""",
    "windowkit.window": """\
import torch, windowkit as wk
from windowkit.backends.tiny import build
from windowkit.window import *
backend = wk.HFBackend(build("tiny-qwen2"))""",
    "windowkit.backends": """\
import torch, windowkit as wk
from windowkit.backends.tiny import build
from windowkit.backends import *
backend = wk.HFBackend(build("tiny-qwen2"))""",
    "windowkit.graph": """\
from windowkit.graph import *""",
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
write_trace(GENERATORS["sliding-3"](steps=20), "run.jsonl")   # a trace file to read below""",
    "windowkit.store": """\
import torch, windowkit as wk
from windowkit.backends.tiny import build
from windowkit.store import *
backend = wk.HFBackend(build("tiny-qwen2"))
a = wk.Chunk.text(torch.randint(10, 120, (64,)))
b = wk.Chunk.text(torch.randint(10, 120, (32,)))
canon = backend.encode(b)                                   # KV(B|∅)
store = ChunkStore(path="kvstore", budget_bytes=1 << 30, model_fingerprint=backend.fingerprint(),
                   layout=backend.layout)                   # windowkit.ChunkStore
key = store.chunk_key(b.content_hash())
store.put_canonical(key, canon)""",
    "policies": """\
import windowkit as wk
from policies import *
from windowkit.trace import CostModelBackend, GENERATORS
steps = GENERATORS["random-lookback-set"](steps=20).steps   # unordered steps: a placement picks the order
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
    "windowkit.window": {
        "RepairRule": 'rule = RepairRule.parse("head+sink:5")\n'
                      'rule.counts([40, 40, 3])                  # [40, 5, 3]: tokens recomputed per stale survivor\n'
                      'win = wk.Window(backend, repair=rule)      # or repair="head+sink:5"; fidelity= picks a rule\n'
                      'win.config.repair_rule.name                # "head+sink:5"',
    },
    "windowkit.backends": {
        "Backend": 'isinstance(backend, Backend)     # True; SGLangBackend and trace.CostModelBackend satisfy it too\n'
                   'res = backend.forward([wk.Chunk.text(torch.randint(10, 120, (8,)))], start=0)\n'
                   'print(res.kv.num_tokens, res.logits.shape, res.spans)   # KV of the new tokens, next-token logits',
    },
    "windowkit.graph": {
        "DependencyGraph": 'g = DependencyGraph(cost_model=TokenCostModel(ms_per_token=0.03, bytes_per_token=8192))\n'
                           'g.add_patch("b", "ctx-b", ["a"], tokens=64)       # b\'s patch formed on [a]\n'
                           'g.add_patch("c", "ctx-c", ["a", "b"], tokens=64)\n'
                           'g.on_evict("a")                  # [PatchRef(\'b\', \'ctx-b\'), PatchRef(\'c\', \'ctx-c\')]: stale now\n'
                           'print(g.on_recall("a", ["a", "b", "c"]))           # the cascade, costed, as a table',
        "TokenCostModel": 'cost = TokenCostModel(ms_per_token=0.03, bytes_per_token=8192)   # forming a patch, per token',
        "divergence": 'divergence(["a", "b"], ["b", "a"])     # small: the same set, reordered\n'
                      'divergence(["a"], ["c"])               # 1.0: nothing shared',
        "reuse_decision": 'score, rebuild = reuse_decision(["a"], ["a", "x"])   # rebuild: a strict superset (App. D)',
    },
    "windowkit.kv": {
        "ChunkKV": 'print(canon.num_tokens, canon.nbytes, canon.layout.describe())\n'
                   'moved = canon.relocate(len(a), spec)                        # R(δ): keys re-rotated, values shared',
        "KVLayout": 'print(backend.layout.family, backend.layout.num_layers, backend.layout.slot_shapes)',
        "concat": 'window_kv = concat([kv_a, canon.relocate(len(a), spec)])   # window order',
        "Patch": 'patch = form_patch(cond, canon, delta=len(a), spec=spec, rank=8)\n'
                 'print(patch.rank, patch.nbytes, patch.layers)',
        "form_patch": 'patch = form_patch(cond, canon, delta=len(a), spec=spec, rank=32)',
        "place": 'kv_b = place(canon, len(a), spec, form_patch(cond, canon, len(a), spec, rank=32))  # no forward',
        "RopeSpec": 'print(spec.rope_type, spec.pairing, spec.mrope, spec.inv_freq.shape)',
        "kl_divergence": 'kl_divergence(torch.randn(200), torch.randn(200))            # nats',
    },
    "windowkit.trace": {
        "ChunkRef": 'ref = ChunkRef(id="frame-12", tokens=64, kind="image")',
        "Step": 'st = Step(step=0, context=[ChunkRef(id="frame-12", tokens=64, kind="image"),\n'
                '                           ChunkRef(id="q", tokens=20)], query_tokens=24)',
        "Trace": 't = Trace([Step(step=0, context=[{"id": "a", "tokens": 4, "kind": "image"}])], name="toy")\n'
                 'print(t.stats())',
        "read_trace": 'trace = read_trace("run.jsonl")',
        "write_trace": 'write_trace(GENERATORS["sliding-3"](steps=20), "run.jsonl")',
        "TraceRecorder": 'win = wk.Window(CostModelBackend("cpu-tiny"))\n'
                         'with TraceRecorder("rec.jsonl") as rec:\n'
                         '    win.assign([CostModelBackend.chunk("f0", 64, "image"), CostModelBackend.chunk("q", 8)])\n'
                         '    rec.record(win, query_tokens=4)                        # the window, in order\n'
                         'print(read_trace("rec.jsonl").steps[0].ids)                # ["f0", "q"]',
        "load_videotree": 'trace = load_videotree(tokens_per_frame=64, max_questions=5)   # the shipped VideoTree file',
        "GENERATORS": 'trace = GENERATORS["sliding-3"](steps=100, k=3)              # a sliding window of 3 shots\n'
                      'print(list(GENERATORS))                                      # every generator\'s name',
        "load_profile": 'p = load_profile("h100-kamera")                               # or "cpu-tiny", or a JSON file path\n'
                        'print(p.prefill_ms(1000), p.kv_bytes_per_token)              # a CostProfile',
        "CostModelBackend": 'cb = CostModelBackend("h100-kamera")\n'
                            'win = wk.Window(cb)                                           # no tensors, modeled ms\n'
                            'win.admit(CostModelBackend.chunk("frame-0", 256, "image"))\n'
                            'print(cb.ledger.total_ms)',
        "simulate": 'res = simulate(GENERATORS["sliding-3"](steps=50), "h100-kamera", strategies=["radix", "windowkit"])',
        "SimResult": 'print(res.table())\nprint(res.summary()["ratios"])                      # {"windowkit/radix": ...}',
        "STRATEGIES": 'print(list(STRATEGIES))                                      # recompute, radix, blind, ...',
    },
    "windowkit.store": {
        "ColdTierConfig": 'store.compress(key, ColdTierConfig(rank=16))                  # low-rank cold copy of a canonical',
        "chunk_key": 'key_b = chunk_key(b.content_hash(), backend.fingerprint())',
        "context_hash": 'ctx = context_hash([chunk_key(a.content_hash(), backend.fingerprint())])   # ordered',
        "EmbeddedBackend": 'shared = EmbeddedBackend()\n'
                           'first, second = ChunkStore(shared=shared), ChunkStore(shared=shared)   # second reads what first put',
        "StoreBackend": 'isinstance(EmbeddedBackend(), StoreBackend)      # the shared-tier protocol (MooncakeBackend: processes)',
        "orbit_context_hash": 'orbit_context_hash(["k1", "k2"]) == orbit_context_hash(["k2", "k1"])   # True',
    },
    "policies": {
        "EvictionPolicy": 'policy = make_eviction_policy("lfu")\n'
                          'isinstance(policy, EvictionPolicy)         # the base: a subclass implements five hooks + victim()\n'
                          'store = wk.ChunkStore(budget_bytes=1 << 20, policy=policy)   # = ChunkStore(..., policy="lfu")',
        "make_eviction_policy": 'policy = make_eviction_policy("lfu")      # ChunkStore(budget_bytes=..., policy=policy)',
        "PlacementPolicy": 'class Reversed(PlacementPolicy):            # a placement orders each unordered step\n'
                           '    name = "reversed"\n'
                           '    def place(self, index, chunks, prev):\n'
                           '        return list(reversed(chunks))\n'
                           'orders = Reversed().resolve(steps)           # simulate(trace, placement=Reversed())',
        "make_placement": 'pol = make_placement("orbit")                                 # OrbitSet()',
        "RefreshPolicy": 'class FirstOnly(RefreshPolicy):              # refresh at most one stale survivor a step\n'
                         '    name = "first-only"\n'
                         '    def select(self, edits):                  # the plan\'s "refresh-patch" edits\n'
                         '        return list(edits[:1])\n'
                         'refreshed = FirstOnly().apply(win)           # the ids re-conditioned',
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


def _default_repr(d, obj) -> str:
    """``repr(d)``, except an absolute path (it depends on the machine: docs/api.md must not): the name of the
    constant of ``obj``'s module that holds it (``DEFAULT_PATH``), else ``'<path>'``."""
    if not (isinstance(d, str) and os.path.isabs(d)):
        return repr(d)
    mod = sys.modules.get(getattr(obj, "__module__", "") or "")
    for n, v in vars(mod).items() if mod is not None else ():
        if n.isupper() and v == d:
            return n
    return "'<path>'"


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
            dr = "..." if d is dataclasses.MISSING or "factory" in repr(d) else _default_repr(d, obj)
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
    if getattr(cls, "_is_protocol", False):  # a Protocol's facts are annotated attributes
        for n, a in cls.__dict__.get("__annotations__", {}).items():
            if not n.startswith("_"):
                out.append(f"- `{n}: {_annotation(a)}` (attribute)")
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
    "windowkit.__version__": "The package version.",
    "windowkit.trace.GENERATORS": (
        "A registry: name -> trace generator (a function of keyword arguments, each with a default, returning a\n"
        "seeded synthetic `Trace`); `windowkit simulate NAME` and `examples/simulate_trace.py --trace NAME` take the\n"
        "names. The `-set` ones mark their steps `ordered: false`, so a placement policy may order them; see\n"
        "[simulation.md](simulation.md)."),
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
    elif inspect.isclass(obj) and getattr(obj, "_is_protocol", False):
        head, desc = f"class {name}(Protocol)", _first_line(obj)
    elif inspect.isclass(obj):
        head, desc = "class " + _signature(obj, name), _first_line(obj)
    elif callable(obj):
        head, desc = _signature(obj, name), _first_line(obj)
    else:
        shown = repr(sorted(obj)) if isinstance(obj, dict) else repr(obj)
        head = f"{name}: {type(obj).__name__} = {shown}" if isinstance(obj, (str, int, float)) else \
            f"{name}: {type(obj).__name__}  # keys: {shown}"
        desc = DESCRIPTIONS.get(f"{mod}.{name}", "A registry: name -> factory." if isinstance(obj, dict) else "A constant.")
    lines += ["```python", head, "```", "", desc or "-", ""]
    if inspect.isclass(obj) and not issubclass(obj, BaseException) and not hasattr(obj, "model_fields"):
        meths = _methods(obj)
        if meths:
            label = "Members" if getattr(obj, "_is_protocol", False) else "Methods and properties"
            lines += [f"{label}:", "", *meths, ""]
    call = EXAMPLES.get(mod, {}).get(name)
    if call is None:
        missing.append(f"{mod}.{name}")
        lines += ["Call: (no example yet)", ""]
    else:
        lines += ["```python", call, "```", ""]
    return lines


# ====================================================================== the surface
def _is_top_level(obj) -> bool:
    import windowkit

    return any(obj is getattr(windowkit, t) for t in windowkit.__all__)


def public_names(mod: str) -> list[str]:
    """The names documented under ``mod``: its ``__all__``; outside the top level, less the names that are
    top-level ones (documented once, under ``windowkit``)."""
    m = importlib.import_module(mod)
    if mod == "windowkit":
        return list(m.__all__)
    return [n for n in m.__all__ if not _is_top_level(getattr(m, n))]


def reexported(mod: str) -> list[str]:
    """The names of ``mod``'s ``__all__`` that are top-level names (``windowkit.store.ChunkStore``)."""
    if mod == "windowkit":
        return []
    m = importlib.import_module(mod)
    return [n for n in m.__all__ if _is_top_level(getattr(m, n))]


def surface() -> dict[str, list[str]]:
    """``{module: the names documented under it}``, in ``MODULES`` order."""
    return {mod: public_names(mod) for mod in MODULES}


def render() -> tuple[str, list[str]]:
    missing: list[str] = []
    surf = surface()
    n_top = len(surf["windowkit"])
    n_sub = sum(len(v) for k, v in surf.items() if k != "windowkit")
    out = ["# API reference", "",
           f"The public surface: {n_top} names at the top level (`windowkit`) and {n_sub} in the subpackages and",
           f"`policies` (at most {SUBPACKAGE_LIMIT}), each with its exact signature, the first paragraph of its docstring",
           "and a call. A subpackage name that is also a top-level one (`windowkit.store.ChunkStore` is",
           "`windowkit.ChunkStore`) is documented once, at the top level. Every other name is private to windowkit:",
           "it stays importable from its module (`from windowkit.window.plan import StepChoice`), and the topic pages",
           "([window](window.md), [store](store.md), [simulation](simulation.md), ...) describe what it does. How the",
           "layers fit together: [architecture](architecture.md).", "",
           "Generated by `scripts/gen_api.py` from the `__all__` of each module below (signatures by `inspect`);",
           "regenerate after changing a public name:",
           "", "```bash", "PYTHONPATH=. .venv/bin/python scripts/gen_api.py            # rewrites this file",
           "PYTHONPATH=. .venv/bin/python scripts/gen_api.py --check    # and runs every call below", "```", "",
           "Each section's calls assume the setup shown at its top. `tests/test_api_surface.py` checks that this",
           "file is what the script writes, that every public name has a docstring, and the limit on the count.", ""]
    body: list[str] = []
    for mod in MODULES:
        m = importlib.import_module(mod)
        body += [f"## {mod}", "", _first_line(m), ""]
        also = reexported(mod)
        if also:
            body += ["Also public here, documented at the top level: " +
                     ", ".join(f"[`{n}`](#{{windowkit.{n}}})" for n in also) + ".", ""]
        if not surf[mod]:
            continue
        body += ["Setup for the calls in this section:", "", "```python", SETUP[mod], "```", ""]
        for name in surf[mod]:
            body += _entry(mod, name, getattr(m, name), missing)
    out += ["## Contents", ""]
    for mod in MODULES:
        names = ", ".join(f"`{n}`" for n in surf[mod])
        also = ", ".join(f"[`{n}`](#{{windowkit.{n}}})" for n in reexported(mod))
        out.append(f"* [`{mod}`](#{{{mod}}}): " + (names or "-") + (f" (and, from the top level, {also})" if also else ""))
    out += ["", *body]
    text = "\n".join(out).rstrip() + "\n"
    anchors = _anchors(out)
    return re.sub(r"\(#\{([\w.]+)\}\)", lambda mt: f"(#{anchors[mt.group(1)]})", text), missing


def _anchors(lines: list[str]) -> dict[str, str]:
    """GitHub's heading anchors: ``{"windowkit.window": "windowkitwindow-1", ...}`` for every ``##`` section and
    ``###`` entry (lower case, punctuation dropped, a repeated anchor numbered: ``windowkit.Window``'s entry
    comes first and takes ``windowkitwindow``)."""
    seen: dict[str, int] = {}
    out: dict[str, str] = {}
    for line in lines:
        mt = re.match(r"#{2,3} `?([^`]+)`?$", line)
        if not mt:
            continue
        slug = re.sub(r"[^\w\- ]", "", mt.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out[mt.group(1)] = slug if n == 0 else f"{slug}-{n}"
    return out


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
            for mod, names in surface().items():
                if not names:
                    continue
                ns: dict = {}
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(SETUP[mod], f"<setup {mod}>", "exec"), ns)
                    m = importlib.import_module(mod)
                    for name in names:
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
