"""windowkit: position-free KV chunks for multimodal agents (Kamera: exact relocation + rank-m patches).

    import windowkit as wk
    backend = wk.HFBackend(model)
    win = wk.Window(backend, rank=32, mode="patch")
    win.admit(wk.Chunk.text(ids_a)); win.admit(wk.Chunk.text(ids_b))
    logits = win.forward(query_ids)
"""
from windowkit.chunk import Chunk
from windowkit.errors import (ChunkError, ChunkNotFoundError, KVShapeError, ModelMismatchError, SharedStoreError, StoreCorruptError,
                              TraceFormatError, UnsupportedModelError, WindowkitError)

__version__ = "0.1.0"


def __getattr__(name: str):  # heavy parts load on first use: `import windowkit` stays cheap
    if name == "HFBackend":
        from windowkit.backends.hf import HFBackend

        return HFBackend
    if name == "Window":
        from windowkit.window import Window

        return Window
    if name == "WindowConfig":
        from windowkit.window import WindowConfig

        return WindowConfig
    if name == "SGLangBackend":  # the module imports no sglang; the engine starts only in launch()
        from windowkit.backends.sglang.backend import SGLangBackend

        return SGLangBackend
    if name == "ChunkStore":
        from windowkit.store import ChunkStore

        return ChunkStore
    raise AttributeError(f"module 'windowkit' has no attribute {name!r}")


__all__ = ["Chunk", "HFBackend", "SGLangBackend", "Window", "WindowConfig", "ChunkStore", "WindowkitError", "UnsupportedModelError",
           "ChunkNotFoundError", "StoreCorruptError", "SharedStoreError", "ModelMismatchError", "TraceFormatError", "ChunkError",
           "KVShapeError", "__version__"]
