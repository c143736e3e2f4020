"""RoPE specs and exact relocation of cached keys.

A cached key at position p is R(p)·k. RoPE rotations compose, R(δ)R(p) = R(p+δ), so moving a cached
chunk by δ positions is one elementwise rotation of its rotary dims: no forward pass, values untouched.

Two pair layouts exist in the wild:
  half        pairs (x_i, x_{i+n}) : rotate_half convention (Llama, Qwen, DeepSeek-V3 in transformers)
  interleaved pairs (x_2i, x_2i+1) : GPT-J convention (DeepSeek-V2 in transformers, V3 in SGLang)

M-RoPE (Qwen2.5-VL, Qwen3-VL) gives each frequency one of three position axes (t, h, w); a relocation
then has one delta per axis. A uniform shift (dt = dh = dw) is a plain 1-D rotation.

    spec = RopeSpec.from_config(model.config)
    k_new = relocate_keys(k_cached, 64, spec)           # any leading shape, rotary dims last
    k_new = relocate_keys(k_cached, (2, 0, 0), spec)    # M-RoPE: per-axis delta (t, h, w)
"""
from __future__ import annotations

import operator

from dataclasses import dataclass
from typing import Any, Literal, Sequence, Union

import torch

from windowkit.errors import KVShapeError, UnsupportedModelError

Pairing = Literal["half", "interleaved"]
MRopeKind = Literal["none", "blocked", "interleaved"]
Delta = Union[int, Sequence[int], torch.Tensor]

# rope types whose inv_freq is fixed for the model's lifetime: a rotation computed now equals the
# one applied at encode time. "dynamic" and "longrope" change inv_freq with sequence length.
_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "proportional"}
_REFUSED_ROPE_TYPES = {"dynamic", "longrope"}


@dataclass(frozen=True)
class RopeSpec:
    """Everything needed to rotate stored keys: frequencies, pair layout and M-RoPE axis map.

    inv_freq: [n] fp32 frequencies, already including llama3/YaRN interpolation (never cos/sin scaling,
              which multiplies magnitudes and is not a rotation).
    axis:     [n] int64, position axis of each frequency (0=t, 1=h, 2=w); all zeros for 1-D RoPE.
    """

    inv_freq: torch.Tensor
    pairing: Pairing = "half"
    mrope: MRopeKind = "none"
    mrope_section: tuple[int, ...] = ()
    rope_type: str = "default"

    @property
    def n_freq(self) -> int:
        return int(self.inv_freq.numel())

    @property
    def rot_dim(self) -> int:
        return 2 * self.n_freq

    @property
    def n_axes(self) -> int:
        return 3 if self.mrope != "none" else 1

    @property
    def axis(self) -> torch.Tensor:
        return _axis_map(self.n_freq, self.mrope, self.mrope_section)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: Any, engine: str = "transformers", inv_freq: torch.Tensor | None = None) -> "RopeSpec":
        """Read the RoPE scheme of a transformers config (a VLM's text_config is found automatically).

        engine names whose *stored* key layout the keys are in. transformers stores DeepSeek-V3's
        ``k_pe`` half-split even when ``rope_interleave=True``; SGLang keeps GPT-J pairs there.

            spec = RopeSpec.from_config(AutoConfig.from_pretrained(path))
        """
        if engine not in ("transformers", "sglang"):
            raise UnsupportedModelError(f"unknown engine {engine!r}; expected 'transformers' or 'sglang'")
        text = getattr(config, "text_config", None) or config
        model_type = str(getattr(text, "model_type", getattr(config, "model_type", "")))
        params = _rope_parameters(text)
        rope_type = str(params.get("rope_type", params.get("type", "default")) or "default")
        if rope_type in _REFUSED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type={rope_type!r} changes its frequencies with sequence length, so a stored key "
                "cannot be re-rotated exactly; windowkit supports default, linear, llama3, yarn"
            )
        if rope_type not in _STATIC_ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported rope_type={rope_type!r} (model_type={model_type!r})")
        if float(params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0 and "deepseek" not in model_type:
            raise UnsupportedModelError("partial_rotary_factor < 1 is not supported yet (rotary dims must be last)")

        if inv_freq is None:
            inv_freq = _inv_freq_from_config(text, rope_type)
        inv_freq = inv_freq.detach().to("cpu", torch.float32).clone()

        pairing: Pairing = "half"
        if model_type.startswith("deepseek_v2"):
            pairing = "interleaved"  # complex-number RoPE: (x0,x1),(x2,x3)... in every engine
        elif model_type.startswith("deepseek_v3") or model_type.startswith("kimi"):
            interleave = bool(getattr(text, "rope_interleave", True))
            pairing = "interleaved" if (engine == "sglang" and interleave) else "half"

        section = params.get("mrope_section")
        mrope: MRopeKind = "none"
        if section is not None:
            section = tuple(int(s) for s in section)
            if model_type.startswith("qwen3_vl"):
                mrope = "interleaved"  # transformers always interleaves for Qwen3-VL
            else:
                mrope = "blocked"
            if mrope == "blocked" and sum(section) != inv_freq.numel():
                raise UnsupportedModelError(f"mrope_section {section} does not sum to {inv_freq.numel()} frequencies")
        return cls(inv_freq=inv_freq, pairing=pairing, mrope=mrope, mrope_section=tuple(section or ()),
                   rope_type=rope_type)

    def with_inv_freq(self, inv_freq: torch.Tensor) -> "RopeSpec":
        return RopeSpec(inv_freq.detach().to("cpu", torch.float32).clone(), self.pairing, self.mrope,
                        self.mrope_section, self.rope_type)


def _rope_parameters(text_config: Any) -> dict:
    params = getattr(text_config, "rope_parameters", None)
    if params is None:  # transformers 4.x style configs
        params = dict(getattr(text_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    return dict(params)


def _inv_freq_from_config(text_config: Any, rope_type: str) -> torch.Tensor:
    if rope_type == "default":
        params = _rope_parameters(text_config)
        base = float(params.get("rope_theta", 10000.0))
        head_dim = getattr(text_config, "qk_rope_head_dim", None) or getattr(text_config, "head_dim", None)
        if head_dim is None:
            head_dim = text_config.hidden_size // text_config.num_attention_heads
        dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    # scaled types: the model's own math; imported here so windowkit.kv (and the store, graph, policies) never
    # loads transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](text_config, "cpu")
    return inv_freq


def _axis_map(n_freq: int, mrope: MRopeKind, section: Sequence[int]) -> torch.Tensor:
    ax = torch.zeros(n_freq, dtype=torch.long)
    if mrope == "blocked":  # first s0 freqs use t, next s1 use h, last s2 use w
        s0, s1, s2 = section
        ax[s0:s0 + s1] = 1
        ax[s0 + s1:s0 + s1 + s2] = 2
    elif mrope == "interleaved":  # Qwen3-VL: j%3==1 -> h (j < 3*s1), j%3==2 -> w (j < 3*s2)
        _s0, s1, s2 = section
        ax[1:3 * s1:3] = 1
        ax[2:3 * s2:3] = 2
    return ax


# ---------------------------------------------------------------------- the rotation
def rotation_angles(delta: Delta, spec: RopeSpec, keys: torch.Tensor) -> torch.Tensor:
    """Per-frequency rotation angle, shape [n] (uniform delta) or [S, n] (per-token delta).

    The angle is the fp32 product delta * inv_freq, exactly as transformers forms position * inv_freq:
    a canonical encoded at position 0 and moved by delta then matches the model's own key at delta
    bit for bit in the angle (fp64 angles would be "more exact" than the model and differ from it by
    ~ulp(delta) radians at large offsets).
    """
    inv = spec.inv_freq.to(keys.device, torch.float32)
    if isinstance(delta, torch.Tensor):
        d = delta.to(keys.device, torch.float32)
        if d.dim() == 0:
            return d * inv
        if d.dim() == 1:  # [S] per-token 1-D deltas
            if d.numel() != keys.shape[-2]:
                raise KVShapeError(f"per-token delta has {d.numel()} entries for {keys.shape[-2]} tokens")
            return d[:, None] * inv[None]
        if d.dim() == 2 and d.shape[1] == 3:  # [S, 3] per-token per-axis deltas
            if spec.n_axes != 3:
                raise KVShapeError("per-axis deltas given for a 1-D RoPE spec")
            if d.shape[0] != keys.shape[-2]:
                raise KVShapeError(f"per-token delta has {d.shape[0]} rows for {keys.shape[-2]} tokens")
            return d[:, spec.axis.to(keys.device)] * inv[None]
        raise KVShapeError(f"cannot read delta of shape {tuple(d.shape)}")
    if isinstance(delta, (list, tuple)):
        seq = list(delta)  # per-axis triple
        if len(seq) != 3:
            raise KVShapeError(f"a per-axis delta needs 3 entries (t, h, w), got {len(seq)}")
        if spec.n_axes != 3 and len(set(_int_delta(x) for x in seq)) != 1:
            raise KVShapeError("per-axis deltas differ but the RoPE spec is 1-D")
        per_freq = torch.tensor([float(_int_delta(x)) for x in seq], dtype=torch.float32, device=keys.device)
        return per_freq[spec.axis.to(keys.device)] * inv
    return torch.tensor(float(_int_delta(delta)), dtype=torch.float32, device=keys.device) * inv


def _exact_angles(delta: Delta, spec: RopeSpec, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[S, n] fp64 angles fl32((p+δ)·inv) − fl32(p·inv): the model's own rounded angles at the target minus
    those the keys were encoded with, so a moved key equals the model's key at the target even at large
    positions (at p ~ 1e5 a plain δ·inv differs from the model's angle by ~ulp(1e5) ≈ 8e-3 rad)."""
    inv = spec.inv_freq.to(keys.device, torch.float32)
    pos = positions.to(keys.device)
    if pos.dim() == 1:
        pos = pos[None]
    if pos.shape[-1] != keys.shape[-2]:
        raise KVShapeError(f"positions cover {pos.shape[-1]} tokens, keys have {keys.shape[-2]}")
    ax = spec.axis.to(keys.device)
    if pos.shape[0] == 1:
        p = pos[0][:, None].expand(-1, spec.n_freq)  # [S, n]
    elif pos.shape[0] == 3 and spec.n_axes == 3:
        p = pos[ax].T  # [S, n]: each frequency reads its own axis
    else:
        raise KVShapeError(f"positions of shape {tuple(pos.shape)} do not fit a {spec.n_axes}-axis RoPE spec")
    if isinstance(delta, torch.Tensor):
        d = delta.to(keys.device)
        if d.dim() == 0:
            dd = d.expand(spec.n_freq)[None]
        elif d.dim() == 1:
            dd = d[:, None].expand(-1, spec.n_freq)
        else:
            dd = d[:, ax]
    elif isinstance(delta, (list, tuple)):
        dd = torch.tensor([int(x) for x in delta], device=keys.device)[ax][None]
    else:
        dd = torch.full((1, spec.n_freq), int(delta), device=keys.device)
    src = p.float() * inv  # fp32 products, as transformers computes position * inv_freq
    dst = (p + dd).float() * inv
    return dst.double() - src.double()


def relocate_keys(keys: torch.Tensor, delta: Delta, spec: RopeSpec,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate post-RoPE keys by ``delta`` positions: returns R(delta)·keys in the input dtype.

    keys:      [..., S, rot_dim] (any leading shape; rotary dims last; S needed for per-token deltas)
    delta:     int, a (dt, dh, dw) tuple for M-RoPE, or a tensor [S] / [S, 3] of per-token deltas
               (a 1-D tensor is always per-token; pass per-axis triples as a tuple).
    positions: optional [S] or [3, S] positions the keys sit at now. With them the rotation reproduces the
               model's own fp32 angle rounding at the target (exact to ~1e-7 at any offset).
    Computes in fp32 (fp64 angles). A delta of 0 returns ``keys`` itself (byte-identical, no rounding).

        k_at_64 = relocate_keys(k_at_0, 64, spec)
    """
    if not isinstance(keys, torch.Tensor) or not keys.is_floating_point():
        raise KVShapeError("keys must be a floating-point tensor")
    if keys.shape[-1] != spec.rot_dim:
        raise KVShapeError(f"keys have {keys.shape[-1]} trailing dims, the RoPE spec rotates {spec.rot_dim}")
    if is_zero_delta(delta):
        return keys
    cos, sin = rotation(delta, spec, keys, positions)
    out = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
    rotate_into(keys, cos, sin, spec, out)
    return out if keys.dtype == torch.float32 else out.to(keys.dtype)


def relocate_keys_many(keys: Sequence[torch.Tensor], delta: Delta, spec: RopeSpec,
                       positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``relocate_keys`` of several tensors that share ``delta`` and ``positions`` (a chunk's layers): the
    rotation (angles, cos, sin) is computed once instead of once per tensor. Bit-identical to calling
    ``relocate_keys`` on each; a tensor of another token count or device gets its own rotation.

        moved = relocate_keys_many([k for k, _v in kv.layers], 64, spec, kv.positions)
    """
    keys = list(keys)
    for k in keys:
        if not isinstance(k, torch.Tensor) or not k.is_floating_point():
            raise KVShapeError("keys must be a floating-point tensor")
        if k.shape[-1] != spec.rot_dim:
            raise KVShapeError(f"keys have {k.shape[-1]} trailing dims, the RoPE spec rotates {spec.rot_dim}")
    if not keys or is_zero_delta(delta):
        return keys
    shared: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for k in keys:
        sig = (k.device, k.shape[-2] if k.dim() >= 2 else None)
        cs = shared.get(sig)
        if cs is None:
            cs = shared[sig] = rotation(delta, spec, k, positions)
        o = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        rotate_into(k, cs[0], cs[1], spec, o)
        out.append(o if k.dtype == torch.float32 else o.to(k.dtype))
    return out


def rotation(delta: Delta, spec: RopeSpec, keys: torch.Tensor,
             positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) of the rotation by ``delta``: [n] for a uniform delta, [S, n] per token."""
    if positions is not None:
        ang = _exact_angles(delta, spec, positions, keys)
        return ang.cos().float(), ang.sin().float()
    ang = rotation_angles(delta, spec, keys)
    return ang.cos(), ang.sin()


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec, out: torch.Tensor) -> None:
    """out = R·x for the pair layout of ``spec``, written in place into fp32 ``out`` (no temporaries:
    two multiplies and two fused multiply-adds, each one pass over half the data)."""
    xf = x if x.dtype == torch.float32 else x.float()
    n = spec.n_freq
    if spec.pairing == "half":
        x1, x2, o1, o2 = xf[..., :n], xf[..., n:], out[..., :n], out[..., n:]
    else:
        x1, x2, o1, o2 = xf[..., 0::2], xf[..., 1::2], out[..., 0::2], out[..., 1::2]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)


def shift_positions(positions: torch.Tensor, delta: Delta) -> torch.Tensor:
    """Positions [n_axes, S] moved by delta (int, per-axis tuple, or per-token tensor)."""
    if isinstance(delta, torch.Tensor):
        d = delta.to(positions.device).long()
        if d.dim() == 0:
            return positions + d
        if d.dim() == 1:
            return positions + d[None]
        return positions + d.T
    if isinstance(delta, (list, tuple)):
        return positions + torch.tensor([int(x) for x in delta], device=positions.device)[:, None]
    return positions + int(delta)


def _int_delta(x: object) -> int:
    """A position offset as an int: ints (numpy's too) and integral floats; anything else is a KVShapeError
    (a fractional offset is never truncated into a wrong rotation)."""
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        if isinstance(x, float) and x.is_integer():
            return int(x)
        raise KVShapeError(f"delta must be an int, a (dt, dh, dw) tuple or a tensor, got {x!r}") from None


def is_zero_delta(delta: Delta) -> bool:
    """True when ``delta`` moves no token (0, or a tensor / sequence of zeros)."""
    if isinstance(delta, torch.Tensor):
        return bool((delta == 0).all())
    if isinstance(delta, (list, tuple)):
        return all(_int_delta(x) == 0 for x in delta)
    return _int_delta(delta) == 0


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at |x| (for tolerance checks)."""
    a = x.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


__all__ = ["RopeSpec", "relocate_keys", "relocate_keys_many", "rotation", "rotate_into", "shift_positions", "bf16_ulp", "Delta"]

