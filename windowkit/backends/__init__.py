"""Backends: the transformers reference backend, the SGLang adapter (windowkit.backends.sglang) and a cost model."""
from windowkit.backends.base import Backend, BackendStats, ForwardResult
from windowkit.backends.hf import HFBackend

__all__ = ["Backend", "BackendStats", "ForwardResult", "HFBackend"]
