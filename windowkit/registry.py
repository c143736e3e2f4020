"""Policies by name, without windowkit importing the ``policies`` package.

windowkit's layers never import ``policies`` (it depends on windowkit, not the other way round). Where
windowkit needs a policy by name, the policy package registers it here when it is imported, and windowkit
loads the providers on the first name it does not know: every module of the ``windowkit.policies`` entry
point group (pyproject.toml), or, where none is installed (a development checkout not re-installed since
the entry point was added), the ``policies`` package.

    register_factory("refresh", make_refresh, names=lambda: list(REFRESH_POLICIES))   # in the provider
    policy = make_policy("refresh", "threshold:0.3")    # in windowkit: loads the providers if needed
    names("refresh")                                    # ["never", "always", "threshold", "budget"]

Eviction policies have their own registry of classes (``windowkit.store.eviction``: ``register_eviction``,
``eviction_policy``), which loads providers the same way.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable, Optional

from windowkit.errors import PolicyError

ENTRY_POINT_GROUP = "windowkit.policies"

# family ("refresh", "placement") -> a function from a spec (name, class, instance or None) to a policy
_FACTORIES: dict[str, Callable[[Any], Any]] = {}
# family -> a function listing the names its factory accepts (called on each ``names``: a provider may load lazily)
_NAMES: dict[str, Callable[[], Iterable[str]]] = {}
_providers_loaded = False


def load_providers() -> None:
    """Import the policy providers once: each module of the ``windowkit.policies`` entry point group, or the
    ``policies`` package if none is installed. Each registers its policies when imported."""
    global _providers_loaded
    if _providers_loaded:
        return

    eps = list(entry_points(group=ENTRY_POINT_GROUP))
    for ep in eps:
        ep.load()
    if not eps:
        try:
            importlib.import_module("policies")
        except ModuleNotFoundError as e:
            if e.name != "policies":
                raise
    _providers_loaded = True  # after a clean load only: a provider that failed to import is retried next time


def register_factory(family: str, factory: Callable[[Any], Any],
                     names: Optional[Callable[[], Iterable[str]]] = None) -> None:
    """Make ``factory(spec)`` the maker of the policies of ``family`` (registering again replaces it);
    ``names()``, when given, lists the names ``factory`` accepts (``names(family)``)."""
    if not callable(factory):
        raise PolicyError(f"a policy factory is callable, got {factory!r}")
    if names is not None and not callable(names):
        raise PolicyError(f"a policy name list is given by a callable, got {names!r}")
    _FACTORIES[family] = factory
    if names is None:
        _NAMES.pop(family, None)
    else:
        _NAMES[family] = names


def make_policy(family: str, spec: Any = None) -> Any:
    """A policy of ``family`` from ``spec``, made by the registered factory; the factory raises ``PolicyError``
    (a ``WindowkitError``) on a bad spec.

        make_policy("refresh", "budget:1")   # -> policies.refresh.Budgeted(1)
    """
    if family not in _FACTORIES:
        load_providers()
    try:
        factory = _FACTORIES[family]
    except KeyError:
        raise PolicyError(f"no {family} policies are registered (is the policies package installed?); "
                          f"known families: {sorted(_FACTORIES)}") from None
    return factory(spec)


def names(family: str) -> list[str]:
    """The policy names of ``family`` its provider registered, in its order (a name with an argument is listed
    bare: "threshold" for "threshold:0.3"). Raises ``PolicyError`` for a family nobody registered or registered
    without names.

        names("placement")   # ["listed", "arrival", "greedy", "orbit", "optimal"]
    """
    if family not in _FACTORIES:
        load_providers()
    if family not in _FACTORIES:
        raise PolicyError(f"no {family} policies are registered (is the policies package installed?); "
                          f"known families: {sorted(_FACTORIES)}")
    lister = _NAMES.get(family)
    if lister is None:
        raise PolicyError(f"the {family} policies were registered without their names")
    return [str(n) for n in lister()]


__all__ = ["ENTRY_POINT_GROUP", "load_providers", "register_factory", "make_policy", "names"]
