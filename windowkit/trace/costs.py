"""Cost profiles: modeled milliseconds and bytes per token for each operation the simulator counts.

A profile is a JSON file (``windowkit/trace/profiles/<name>.json``) with a ``source`` field saying where
every number comes from. Costs scale linearly with tokens (an assumption: attention's quadratic term and
kernel launch overheads are ignored).

    prof = load_profile("h100-kamera")          # or a path to a JSON file
    prof.prefill_ms(1024)                       # ~430 ms
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Union

from windowkit.errors import WindowkitError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class CostProfile:
    """Per-token costs of one device/model pair.

    vision_encode_ms_per_token  vision tower, per visual token (paid once per chunk if embeddings are cached)
    prefill_ms_per_token        LLM prefill (a conditioned forward, a canonical encode, a re-prefill, the query)
    kv_replay_ms_per_token      placing stored KV at a position (copy + RoPE re-rotation of the keys)
    patch_apply_ms_per_token    the rank-m add U_m V_mᵀ at placement
    patch_form_ms_per_token     SVD of a deficit when a patch is formed (the forwards are charged as prefill)
    kv_bytes_per_token          KV bytes of one token (all layers, K and V)
    patch_bytes_per_token       rank-m patch bytes per chunk token
    """

    name: str
    source: str
    vision_encode_ms_per_token: float
    prefill_ms_per_token: float
    kv_replay_ms_per_token: float
    patch_apply_ms_per_token: float
    patch_form_ms_per_token: float
    kv_bytes_per_token: int
    patch_bytes_per_token: int
    device: str = ""
    notes: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith(("_per_token",)) and (not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                raise WindowkitError(f"profile {self.name!r}: {f.name} must be a finite number >= 0, got {v!r}")
        if not self.source:
            raise WindowkitError(f"profile {self.name!r}: 'source' must say where the numbers come from")

    # modeled milliseconds of an operation over n tokens
    def prefill_ms(self, tokens: int) -> float:
        return tokens * self.prefill_ms_per_token

    def vision_ms(self, tokens: int) -> float:
        return tokens * self.vision_encode_ms_per_token

    def replay_ms(self, tokens: int) -> float:
        return tokens * self.kv_replay_ms_per_token

    def patch_apply_ms(self, tokens: int) -> float:
        return tokens * self.patch_apply_ms_per_token

    def patch_form_ms(self, tokens: int) -> float:
        return tokens * self.patch_form_ms_per_token

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in d and f.name not in ("device", "notes")]
        if missing:
            raise WindowkitError(f"cost profile lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Union[str, os.PathLike]) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return p


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: Union[str, os.PathLike, CostProfile]) -> CostProfile:
    """A built-in profile by name (``available_profiles()``) or a JSON file path.

        prof = load_profile("cpu-tiny")
    """
    if isinstance(name_or_path, CostProfile):
        return name_or_path
    p = Path(name_or_path)
    if not p.suffix and not p.exists():
        p = PROFILE_DIR / f"{name_or_path}.json"
    if not p.is_file():
        raise WindowkitError(f"no cost profile {str(name_or_path)!r}; built-in: {', '.join(available_profiles())}")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise WindowkitError(f"{p}: not valid JSON: {e}") from None
    return CostProfile.from_dict(d)


__all__ = ["CostProfile", "load_profile", "available_profiles", "PROFILE_DIR"]
