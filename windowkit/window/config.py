"""WindowConfig: the Window's settings in one frozen, validated value.

    cfg = WindowConfig(rank=16, fidelity="fast")
    win = Window(backend, config=cfg)            # same window as Window(backend, rank=16, fidelity="fast")
    win.config.repair_rule.name                  # "none"

Every setting is checked once, in ``__post_init__``, with the errors the Window's keyword arguments raised
before (``WindowkitError``). The Window's resources (``store``, ``prefix``, ``basis``, ``cache_salt``,
``auth_key``) are not settings: they stay keyword arguments of ``Window``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, Optional, Sequence, Union

from windowkit.errors import WindowkitError
from windowkit.window.plan import RepairRule, repair_rule

Mode = Literal["patch", "blind", "exact"]


@dataclass(frozen=True)
class WindowConfig:
    """The Window's settings (see ``Window`` for what each one does).

    mode:            "patch" (default) | "blind" | "exact"
    rank:            patch rank m (default 32); None keeps full rank
    patch_layers:    None (default: all) | "deep" | list of layer ids
    svd:             "exact" (default) | "randomized"
    removal_patches: False (default); True re-conditions survivors after an eviction with a removal patch
    removal_rank:    rank of removal patches (default 64)
    orbit_samples:   orderings sampled to form an orbit patch (default 24)
    cascade:         "plan" (default) | "apply"
    form:            "lazy" (default) | "eager"
    fidelity:        "balanced" (default) | "exact" | "fast" | a next-token KL target in nats
    repair:          None (default: the rule ``fidelity`` picks) | a repair spec string | a RepairRule
    cap:             True (default): never plan an assign / reorder step dearer than a prefix cache
    focus_budget:    0.58 (default) | None: the query focus's share of a prefix cache's step
    """

    mode: Mode = "patch"
    rank: Optional[int] = 32
    patch_layers: Union[None, str, Sequence[int]] = None
    svd: str = "exact"
    removal_patches: bool = False
    removal_rank: Optional[int] = 64
    orbit_samples: int = 24
    cascade: str = "plan"
    form: str = "lazy"
    fidelity: Union[str, float] = "balanced"
    repair: Union[str, RepairRule, None] = None
    cap: bool = True
    focus_budget: Optional[float] = 0.58
    # the survivor repair rule ``fidelity`` and ``repair`` resolve to (derived, not a setting)
    repair_rule: RepairRule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in ("patch", "blind", "exact"):
            raise WindowkitError(f"mode must be 'patch', 'blind' or 'exact', got {self.mode!r}")
        if self.rank is not None and int(self.rank) < 1:
            raise WindowkitError(f"rank must be >= 1 or None (full rank), got {self.rank}")
        if self.cascade not in ("plan", "apply"):
            raise WindowkitError(f"cascade must be 'plan' or 'apply', got {self.cascade!r}")
        if self.form not in ("eager", "lazy"):
            raise WindowkitError(f"form must be 'eager' or 'lazy', got {self.form!r}")
        object.__setattr__(self, "repair_rule", repair_rule(self.fidelity, self.repair))
        object.__setattr__(self, "cap", bool(self.cap))
        fb = self.focus_budget
        if fb is not None and not 0 < float(fb) <= 1:
            raise WindowkitError(f"focus_budget must be in (0, 1] or None, got {fb!r}")
        object.__setattr__(self, "focus_budget", None if fb is None else float(fb))

    @classmethod
    def settings(cls) -> tuple[str, ...]:
        """Names of the settings (the init fields), in declaration order."""
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def defaults(cls) -> dict:
        """The documented default of every setting."""
        return {f.name: f.default for f in fields(cls) if f.init}


__all__ = ["WindowConfig", "Mode"]
