"""Shared helpers of the live SGLang tests (tests/test_sglang_live.py, tests/test_sglang_server.py): the same
window (chunks A, B, C of 64 tokens from SmolLM2's tokenizer, A evicted, then a question), the HF backend over
the same checkpoint, the linker's stats file, and the engine's full-vocabulary next-token log-probabilities."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest
import torch

from windowkit.backends.hf import HFBackend
from windowkit.models.load import load_model
from windowkit.backends.sglang.cpu_engine import EngineStartError
from windowkit.chunk import Chunk
from windowkit.models import smollm2
from windowkit.window import Window

PAGE = 16
CHUNK = 64
NEW = 6  # greedy tokens compared
TEXTS = (
    "The harbour town of Kelport keeps a lighthouse painted red and white. Its keeper, Mara, logs every ship "
    "that passes, noting the weather, the cargo and the flag of each one. ",
    "In the spring the fishing fleet returns with herring and cod, and the market square fills with stalls "
    "selling rope, nets, fresh bread and smoked fish to the sailors. ",
    "Last winter a storm broke the harbour wall, and the town council voted to rebuild it with granite from "
    "the northern quarry, paid for by a tax on every barrel of oil. ",
)
QUESTION = " Question: what colour is the lighthouse? Answer:"

T = TypeVar("T")


class SmolWindow:
    """The HF backend over SmolLM2's checkpoint, the token ids of A, B, C and the question, and the linker's
    stats file (``tmp/linker_stats.json``); subclasses start the SGLang side."""

    def __init__(self, tmp: Path):
        torch.set_num_threads(1)  # the engine's scheduler computes on the other core
        self.tok = smollm2.load_tokenizer()
        self.ids = [self.tok(t * 2)["input_ids"][:CHUNK] for t in TEXTS]  # each text twice: >= 64 tokens
        self.q = self.tok(QUESTION)["input_ids"]
        self.hf = HFBackend(load_model("smollm2"))
        self.vocab = int(self.hf.model.config.vocab_size)
        self.stats_path = tmp / "linker_stats.json"

    @property
    def prompt(self) -> list[int]:
        return self.ids[1] + self.ids[2] + self.q

    def stats(self) -> dict:
        return json.loads(self.stats_path.read_text()) if self.stats_path.exists() else {}

    def window(self, mode: str) -> Window:
        """[A, B, C], then A evicted: the window is [B, C] at positions 0..127."""
        w = Window(self.hf, rank=16, mode=mode)
        for name, ids in zip("ABC", self.ids):
            w.admit(Chunk.text(torch.tensor(ids), id=name))
        w.evict("head")
        return w

    def next_token_logprobs(self, out: dict) -> torch.Tensor:
        """The engine's full-vocabulary next-token log-probabilities of a 1-token request."""
        top = out["meta_info"]["output_top_logprobs"][0]
        assert len(top) == self.vocab
        lp = torch.full((self.vocab,), float("-inf"), dtype=torch.float64)
        for value, token, *_ in top:
            lp[int(token)] = value
        return lp


def running(start: Callable[[], T], what: str, stop: Callable[[T], None]) -> Iterator[T]:
    """A fixture's body: yield ``start()`` and ``stop`` it afterwards; when it cannot start, fail the test
    (never skip) with ``what`` and the engine's reason."""
    try:
        obj = start()
    except EngineStartError as e:
        pytest.fail(f"{what}:\n{e}", pytrace=False)
    try:
        yield obj
    finally:
        stop(obj)
