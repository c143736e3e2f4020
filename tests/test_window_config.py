"""WindowConfig: the Window's settings as one frozen, validated value; keywords and config build the same
Window, bad values raise what the keywords raised, and a keyword contradicting the config is refused."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import windowkit as wk
from windowkit.errors import WindowkitError
from windowkit.trace.backend import CostModelBackend
from windowkit.window import WindowConfig
from windowkit.window.plan import RepairRule, repair_rule

from model_helpers import llama, text  # noqa: F401  (module-scoped fixture, tests/model_helpers.py)

torch.set_num_threads(1)

# the documented defaults (docs/window.md, the Window docstring; tests/test_defaults.py for the first ones)
DOCUMENTED = {"mode": "patch", "rank": 32, "patch_layers": None, "svd": "exact", "removal_patches": False,
              "removal_rank": 64, "orbit_samples": 24, "cascade": "plan", "form": "lazy", "fidelity": "balanced",
              "repair": None, "cap": True, "focus_budget": 0.58}

BAD = [{"mode": "fast"}, {"rank": 0}, {"cascade": "never"}, {"form": "soon"}, {"fidelity": "perfect"},
       {"repair": "sometimes"}, {"focus_budget": 0}, {"focus_budget": 1.5}]


def test_defaults_are_the_documented_ones():
    assert WindowConfig.defaults() == DOCUMENTED
    assert set(WindowConfig.settings()) == set(DOCUMENTED)
    sig = inspect.signature(wk.Window.__init__).parameters
    for k, v in DOCUMENTED.items():
        assert sig[k].default == v, f"Window keyword {k} defaults to {sig[k].default!r}, config to {v!r}"
    cfg = WindowConfig()
    assert cfg.repair_rule == repair_rule("balanced") and cfg.repair_rule.name == "head:128+query:96"


def test_exported_and_frozen():
    assert wk.WindowConfig is WindowConfig and "WindowConfig" in wk.__all__
    cfg = WindowConfig(rank=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rank = 4  # type: ignore[misc]
    assert dataclasses.replace(cfg, rank=4).rank == 4 and cfg.rank == 8


def test_window_config_is_its_settings():
    b = CostModelBackend()
    win = wk.Window(b, rank=8, fidelity="fast", focus_budget=None)
    assert win.config == WindowConfig(rank=8, fidelity="fast", focus_budget=None)
    assert (win.rank, win.fidelity, win.focus_budget, win.repair.name) == (8, "fast", None, "none")
    cfg = WindowConfig(mode="blind", form="eager", cap=0)
    w2 = wk.Window(b, config=cfg)
    assert w2.config is cfg and (w2.mode, w2.form, w2.cap) == ("blind", "eager", False)
    assert wk.Window(b).config == WindowConfig()


@pytest.mark.parametrize("bad", BAD, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_bad_values_raise_the_same_error(bad):
    with pytest.raises(WindowkitError) as by_kw:
        wk.Window(CostModelBackend(), **bad)
    with pytest.raises(WindowkitError) as by_cfg:
        WindowConfig(**bad)
    assert str(by_kw.value) == str(by_cfg.value)


def test_conflicting_keyword_raises():
    b = CostModelBackend()
    cfg = WindowConfig(rank=8, repair="head")
    with pytest.raises(WindowkitError, match="rank"):
        wk.Window(b, config=cfg, rank=16)
    with pytest.raises(WindowkitError, match="repair"):
        wk.Window(b, config=cfg, repair="all")
    with pytest.raises(WindowkitError, match="config"):
        wk.Window(b, config={"rank": 8})  # type: ignore[arg-type]
    # agreeing keywords and keywords left at their defaults are not conflicts
    assert wk.Window(b, config=cfg, rank=8, repair="head").config is cfg
    assert wk.Window(b, config=cfg, mode="patch").config is cfg
    assert wk.Window(b, config=WindowConfig(repair=RepairRule.parse("head")), repair="head").rank == 32


def test_config_and_keywords_give_identical_windows(llama):  # noqa: F811
    chunks = [text(llama, 12, s, f"k{s}") for s in range(4)]
    query = [11, 12, 13]
    for kw in ({}, {"rank": 4, "fidelity": "exact"}, {"mode": "blind"}, {"repair": "head+query:8",
                                                                         "focus_budget": None, "form": "eager"}):
        wins = [wk.Window(llama, **kw), wk.Window(llama, config=WindowConfig(**kw))]
        outs = []
        for w in wins:
            for c in chunks:
                w.admit(c)
            w.evict("head")
            w.recall(chunks[0].id, at=1)
            outs.append((w.forward(query), w.ids, w.stats.as_dict(), w.stale_ids()))
        (la, ia, sa, xa), (lb, ib, sb, xb) = outs
        assert torch.equal(la, lb) and ia == ib and xa == xb, kw
        sa.pop("est_ms_saved"), sb.pop("est_ms_saved")  # measured wall time
        assert sa == sb, kw
