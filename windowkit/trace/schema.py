"""The trace schema: one agent step per JSON Lines record (pydantic models, validation only).

    {"step": 0, "context": [{"id": "frame-12", "tokens": 64, "kind": "video"},
                            {"id": "q0", "tokens": 20, "kind": "text"}],
     "ordered": true, "query_tokens": 24}

``context`` is what the agent wants in its window at that step, in its preferred order; ``ordered: false``
means any order of that set is acceptable. A chunk id names one piece of content for the whole trace: the
same id at two steps is the same frame / screenshot / text span, so its token count and kind must agree.

    from windowkit.trace import Step, Trace
    t = Trace([Step(step=0, context=[{"id": "a", "tokens": 4, "kind": "image"}])], name="toy")
    t.distinct_chunks()   # {"a": ChunkRef(id="a", tokens=4, kind="image")}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from windowkit.errors import TraceFormatError

ChunkKind = Literal["text", "image", "video"]


class ChunkRef(BaseModel):
    """One chunk of a step's context: an id (stable across the trace), its token count and modality."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    tokens: int = Field(ge=1)
    kind: ChunkKind = "text"

    @property
    def is_visual(self) -> bool:
        return self.kind != "text"


class Step(BaseModel):
    """One agent step: the wanted window content (in order unless ``ordered`` is false) and the query size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(ge=0)
    context: list[ChunkRef]
    ordered: bool = True
    query_tokens: int = Field(default=0, ge=0)

    @field_validator("context")
    @classmethod
    def _distinct(cls, v: list[ChunkRef]) -> list[ChunkRef]:
        seen: set[str] = set()
        for c in v:
            if c.id in seen:  # a window holds a chunk once; a repeated frame is a new id
                raise ValueError(f"chunk id {c.id!r} appears twice in one step's context")
            seen.add(c.id)
        return v

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.context]

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.context)


@dataclass
class Trace:
    """A list of steps plus a name and free-form metadata (where it came from, generator parameters)."""

    steps: list[Step]
    name: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check()

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def check(self) -> None:
        """Raise TraceFormatError if one id carries two different token counts or kinds."""
        known: dict[str, ChunkRef] = {}
        for s in self.steps:
            for c in s.context:
                k = known.setdefault(c.id, c)
                if k.tokens != c.tokens or k.kind != c.kind:
                    raise TraceFormatError(f"step {s.step}: chunk {c.id!r} was {k.tokens} {k.kind} tokens earlier, "
                                           f"now {c.tokens} {c.kind}")

    def distinct_chunks(self) -> dict[str, ChunkRef]:
        out: dict[str, ChunkRef] = {}
        for s in self.steps:
            for c in s.context:
                out.setdefault(c.id, c)
        return out

    def stats(self) -> dict:
        """Shape of the trace: steps, distinct chunks, mean chunks and tokens per step."""
        n = max(len(self.steps), 1)
        return {"steps": len(self.steps), "distinct_chunks": len(self.distinct_chunks()),
                "mean_chunks_per_step": sum(len(s.context) for s in self.steps) / n,
                "mean_tokens_per_step": sum(s.tokens for s in self.steps) / n,
                "max_chunks_per_step": max((len(s.context) for s in self.steps), default=0)}


__all__ = ["ChunkKind", "ChunkRef", "Step", "Trace"]
