"""Read and write traces as JSON Lines (one ``Step`` per line; blank lines are skipped).

    from windowkit.trace import read_trace, write_trace
    write_trace(trace, "run.jsonl")
    trace = read_trace("run.jsonl")      # TraceFormatError("run.jsonl:3: ...") names the bad line
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Union

from pydantic import ValidationError

from windowkit.errors import TraceFormatError
from windowkit.trace.schema import Step, Trace

PathLike = Union[str, os.PathLike]


def _explain(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)


def iter_steps(path: PathLike) -> Iterator[Step]:
    """Yield the steps of a JSONL trace one by one (constant memory); errors name file and line."""
    p = Path(path)
    try:
        fh = open(p, encoding="utf-8")
    except OSError as e:
        raise TraceFormatError(f"{p}: cannot read trace: {e}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            try:
                yield Step.model_validate(obj)
            except ValidationError as e:
                raise TraceFormatError(f"{p}:{lineno}: {_explain(e)}") from None


def read_trace(path: PathLike, name: str = "") -> Trace:
    """The whole trace in memory; also checks that each id keeps one token count and kind."""
    steps = list(iter_steps(path))
    try:
        return Trace(steps, name=name or Path(path).stem)
    except TraceFormatError as e:
        raise TraceFormatError(f"{path}: {e}") from None


def write_trace(trace: Union[Trace, list[Step]], path: PathLike) -> Path:
    """Write one compact JSON object per step. Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    steps = trace.steps if isinstance(trace, Trace) else trace
    with open(p, "w", encoding="utf-8") as fh:
        for s in steps:
            fh.write(s.model_dump_json())
            fh.write("\n")
    return p


__all__ = ["iter_steps", "read_trace", "write_trace"]
