"""The KV operator: exact RoPE relocation + rank-m conditioning patches, independent of any model class."""
from windowkit.kv.layout import ChunkKV, KVLayout, concat
from windowkit.kv.metrics import eta, kl_divergence
from windowkit.kv.patch import (Patch, apply_patch, deficit, form_orbit_patch, form_patch, form_removal_patch,
                                orderings, patch_from_deficit, place, reconstruction_error)
from windowkit.kv.rope import RopeSpec, relocate_keys
from windowkit.kv.svd import truncated_svd

# the public names (docs/api.md); the others imported above stay importable from here and from their modules
__all__ = ["ChunkKV", "KVLayout", "RopeSpec", "Patch", "concat", "form_patch", "place", "kl_divergence"]
