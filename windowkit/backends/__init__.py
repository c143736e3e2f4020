"""Backends: the transformers reference backend (and, later, the SGLang adapter and a cost model)."""
from windowkit.backends.base import Backend, BackendStats, ForwardResult
from windowkit.backends.hf import HFBackend

__all__ = ["Backend", "BackendStats", "ForwardResult", "HFBackend"]
