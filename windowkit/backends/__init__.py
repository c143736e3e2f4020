"""Backends: the transformers reference backend, the SGLang adapter (windowkit.backends.sglang) and a cost model."""
from windowkit.backends.base import Backend, BackendStats, ForwardResult
from windowkit.backends.hf import HFBackend

# the public names (docs/api.md); the others imported above stay importable from here and from their modules
__all__ = ["Backend", "HFBackend"]
