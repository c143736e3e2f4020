"""``windowkit calibrate``: measure a cost profile on this machine and write it as JSON for ``--profile PATH``.

    windowkit calibrate                                   # ./windowkit-profile.json, ~15 s on one core
    windowkit calibrate --tokens 1024 --threads 2 --repeats 9 --out prof.json
    windowkit simulate videotree:50 --profile prof.json

The timing itself is ``windowkit.trace.measure.measure_profile`` (tiny random models on the CPU: prefill,
KV replay, patch apply, patch SVD, vision tower); this module names the profile, shows progress and
prints the result as a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from windowkit.errors import WindowkitError
from windowkit.trace.costs import CostProfile
from windowkit.trace.measure import measure_profile

DEFAULT_OUT = "windowkit-profile.json"
_UNITS = {"kv_bytes_per_token": "bytes", "patch_bytes_per_token": "bytes"}


def profile_table(p: CostProfile) -> str:
    """The per-token numbers of ``p`` as a small aligned text table (field, value, unit)."""
    rows = [(f.name, getattr(p, f.name)) for f in dataclasses.fields(p) if f.name.endswith("_per_token")]
    w = max(len(k) for k, _ in rows)
    lines = [f"{'field':<{w}}  {'value':>12}  unit", f"{'-' * w}  {'-' * 12}  ----"]
    for k, v in rows:
        unit = _UNITS.get(k, "ms")
        lines.append(f"{k:<{w}}  {v:>12,}  {unit}" if unit == "bytes" else f"{k:<{w}}  {v:>12.5f}  {unit}")
    return "\n".join(lines)


class _Ticker:
    """Prints 'measuring ... N s' on stderr once a second while the measurement runs (a TTY rewrites the
    line in place; a log gets a line every 5 s), so a long calibration is visibly alive."""

    def __init__(self, label: str, stream=None):
        self.label, self.stream = label, stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.perf_counter()

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(1.0):
            n += 1
            if self.tty:
                self.stream.write(f"\r{self.label} {n} s")
                self.stream.flush()
            elif n % 5 == 0:
                self.stream.write(f"  ... {n} s\n")
                self.stream.flush()

    def __enter__(self) -> "_Ticker":
        self.stream.write(f"{self.label}\n" if not self.tty else self.label)
        self.stream.flush()
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._stop.set()
        self._thread.join()
        how = "failed after" if exc_type else "done in"
        self.stream.write(f"{chr(13) if self.tty else ''}{self.label} {how} {time.perf_counter() - self.t0:.1f} s\n")
        self.stream.flush()


def _check(tokens: int, threads: int, repeats: int, rank: int) -> None:
    for k, v in (("tokens", tokens), ("threads", threads), ("repeats", repeats), ("rank", rank)):
        if not isinstance(v, int) or v < 1:
            raise WindowkitError(f"calibrate: {k} must be a positive integer, got {v!r}")
    if rank > tokens:
        raise WindowkitError(f"calibrate: rank {rank} exceeds tokens {tokens}")


def calibrate(model: str = "tiny-qwen2", vl_model: str = "tiny-qwen2.5-vl", tokens: int = 512, threads: int = 1,
              repeats: int = 5, rank: int = 32, name: Optional[str] = None) -> CostProfile:
    """Measure a CostProfile on this machine (``measure_profile``) and name it for this host.

        prof = calibrate(tokens=64, repeats=1)
        prof.save("windowkit-profile.json")
    """
    _check(tokens, threads, repeats, rank)
    p = measure_profile(model=model, vl_model=vl_model, tokens=tokens, rank=rank, repeats=repeats, threads=threads)
    # measure_profile names its result "cpu-tiny" (the built-in); a calibration is this machine's own
    return dataclasses.replace(p, name=name or f"calibrated-{platform.node() or 'host'}",
                               notes=f"{p.notes}; measured by `windowkit calibrate` on {platform.node() or 'this host'} "
                                     f"({platform.machine()}, {platform.python_implementation()} "
                                     f"{platform.python_version()})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``windowkit calibrate`` (dispatched by ``windowkit/cli.py``).

        main(["--tokens", "64", "--repeats", "1", "--out", "prof.json"])
    """
    ap = argparse.ArgumentParser(prog="windowkit calibrate",
                                 description="measure a cost profile (ms and bytes per token) on this machine")
    ap.add_argument("--model", default="tiny-qwen2", help="text model to time prefill, replay, patches on")
    ap.add_argument("--vl-model", default="tiny-qwen2.5-vl", help="VL model whose vision tower is timed")
    ap.add_argument("--tokens", type=int, default=512, help="tokens of the timed chunk (default 512)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while timing (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per operation; the median is kept (default 5)")
    ap.add_argument("--rank", type=int, default=32, help="patch rank (default 32)")
    ap.add_argument("--name", default=None, help="profile name (default calibrated-<hostname>)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"JSON file to write (default ./{DEFAULT_OUT})")
    a = ap.parse_args(None if argv is None else list(argv))
    label = (f"calibrate: timing {a.model} + {a.vl_model} vision, {a.tokens} tokens, {a.repeats} repeats, "
             f"{a.threads} thread(s)...")
    _check(a.tokens, a.threads, a.repeats, a.rank)
    out = Path(a.out)
    try:  # fail before the measuring, not after it
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WindowkitError(f"calibrate: cannot write {out}: {e}") from None
    if out.is_dir():
        raise WindowkitError(f"calibrate: --out {out} is a directory; give a file path such as {out / DEFAULT_OUT}")
    with _Ticker(label):
        prof = calibrate(a.model, a.vl_model, a.tokens, a.threads, a.repeats, a.rank, a.name)
    prof.save(out)
    print(f"profile {prof.name} ({prof.device})")
    print(profile_table(prof))
    print(f"wrote {out}  (use: windowkit simulate TRACE --profile {out})")
    return 0


__all__ = ["calibrate", "profile_table", "main", "DEFAULT_OUT"]
