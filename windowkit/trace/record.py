"""Record a trace from a live Window: one ``Step`` per call, written as a JSON Lines line at once.

    from windowkit.trace import TraceRecorder, read_trace, simulate
    with TraceRecorder("run.jsonl") as rec:
        for frames in agent_steps:
            win.assign(frames + [question])
            rec.record(win, query_tokens=len(prompt_ids))   # the window's chunks, in window order
            logits = win.forward(prompt_ids)
    res = simulate(read_trace("run.jsonl"), "h100-kamera")

Each step's ``context`` is the window's current chunks in window order: ``id`` is the chunk's id (a
``Chunk`` without an explicit id carries its content hash, so the same content keeps the same id),
``tokens`` its token count and ``kind`` its modality (text | image | video). The window's fixed prefix
is left out unless ``prefix=True`` (it never moves, so replaying it changes no strategy's reuse).

Lines are written and flushed one step at a time (the io.py format: one compact object per line), so a
run that dies mid-way leaves a readable trace of the steps done so far. A step that would make the file
unreadable (an id seen before with another token count or kind) raises ``TraceFormatError`` before
anything is written.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Any, Iterator, Optional, Sequence, Union

from pydantic import ValidationError

from windowkit.chunk import Chunk
from windowkit.errors import TraceFormatError, WindowkitError
from windowkit.trace.schema import ChunkRef, Step

PathOrFile = Union[str, os.PathLike, IO[str]]


def _ref(chunk: Chunk) -> ChunkRef:
    return ChunkRef(id=chunk.id or chunk.content_hash()[:16], tokens=len(chunk), kind=chunk.kind)


class TraceRecorder:
    """Append one trace step per ``record`` call to a JSONL file (a path, truncated on open, or an open text file).

    prefix: also record the window's fixed prefix chunk (if it has one) first in every step.

        rec = TraceRecorder("run.jsonl"); rec.record(win, query_tokens=3); rec.close()
    """

    def __init__(self, path_or_file: PathOrFile, *, prefix: bool = False):
        self.prefix = bool(prefix)
        self.steps: list[Step] = []  # everything recorded so far (what the file holds)
        self._known: dict[str, ChunkRef] = {}
        if isinstance(path_or_file, (str, os.PathLike)):
            self.path: Optional[Path] = Path(path_or_file)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh: Optional[IO[str]] = open(self.path, "w", encoding="utf-8")
            except OSError as e:
                raise TraceFormatError(f"{self.path}: cannot write trace: {e}") from None
            self._owns = True
        elif hasattr(path_or_file, "write"):
            self.path = Path(path_or_file.name) if isinstance(getattr(path_or_file, "name", None), str) else None
            self._fh = path_or_file
            self._owns = False  # the caller opened it, the caller closes it
        else:
            raise TraceFormatError("TraceRecorder needs a path or an open text file, "
                                   f"got {type(path_or_file).__name__}")

    # ------------------------------------------------------------------ recording
    def record(self, window: Any, query_tokens: int = 0, ordered: bool = True) -> Step:
        """Append the window's current content as the next step and return it.

        window: a ``Window`` (its ``ids`` in order, each looked up with ``window.chunk``) or a sequence of
        ``Chunk`` objects (recorded as given). query_tokens: tokens the agent runs after the window this step.
        ordered: False when any order of the set would serve the agent.
        """
        if self._fh is None:
            raise WindowkitError("TraceRecorder is closed")
        chunks = self._chunks(window)
        try:
            step = Step(step=len(self.steps), context=[_ref(c) for c in chunks], ordered=bool(ordered),
                        query_tokens=int(query_tokens))
        except ValidationError as e:
            raise TraceFormatError(f"step {len(self.steps)}: {e.errors()[0].get('msg')}") from None
        for c in step.context:  # the check read_trace makes, done before writing so the file stays readable
            k = self._known.get(c.id)
            if k is not None and (k.tokens != c.tokens or k.kind != c.kind):
                raise TraceFormatError(f"step {step.step}: chunk {c.id!r} was {k.tokens} {k.kind} tokens earlier, "
                                       f"now {c.tokens} {c.kind}")
        for c in step.context:
            self._known.setdefault(c.id, c)
        self._fh.write(step.model_dump_json() + "\n")
        self._fh.flush()  # line by line: a crash leaves the steps done so far readable
        self.steps.append(step)
        return step

    def _chunks(self, window: Any) -> list[Chunk]:
        if hasattr(window, "ids") and hasattr(window, "chunk"):
            chunks = [window.chunk(cid) for cid in window.ids]
            pre = getattr(window, "prefix", None)
            if self.prefix and pre is not None:
                chunks.insert(0, pre)
            return chunks
        if isinstance(window, Sequence) and all(isinstance(c, Chunk) for c in window):
            return list(window)
        raise TraceFormatError(f"record expects a Window or a sequence of Chunks, got {type(window).__name__}")

    # ------------------------------------------------------------------ closing
    @property
    def closed(self) -> bool:
        return self._fh is None

    def close(self) -> None:
        """Flush and close (a file the recorder opened; a caller's file is only flushed). Idempotent."""
        if self._fh is None:
            return
        fh, self._fh = self._fh, None
        fh.flush()
        if self._owns:
            try:
                os.fsync(fh.fileno())
            except (OSError, ValueError):  # not every file object has a real descriptor
                pass
            fh.close()

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.steps)


@contextlib.contextmanager
def recording(owner: Any, path: Optional[PathOrFile]) -> Iterator[Optional[TraceRecorder]]:
    """``owner.recorder`` is a TraceRecorder on ``path`` for the block (None when ``path`` is None), closed after
    it even on error, so a failed run leaves a readable trace of the steps done so far.

        with recording(self, self.record):       # an agent's run(); its step() calls self.recorder.record(...)
            for s in steps: self.step(s)
    """
    owner.recorder = TraceRecorder(path) if path is not None else None
    try:
        yield owner.recorder
    finally:
        if owner.recorder is not None:
            owner.recorder.close()
        owner.recorder = None


__all__ = ["TraceRecorder", "recording"]
