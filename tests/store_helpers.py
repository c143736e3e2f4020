"""Shared helpers of the store tests (tests/test_mooncake.py, tests/test_security.py): the tiny Qwen2 backend, a
loopback Mooncake Store for the module, seeded text chunks, and transformers' own forward as ground truth."""
from __future__ import annotations

import pytest
import torch

import windowkit as wk
from windowkit.backends.tiny import build
from windowkit.kv.layout import KVLayout
from windowkit.store.mooncake import LocalMooncake

QUERY = torch.tensor([11, 12, 13, 14])
LAYOUT = KVLayout("llama", 2, ((2, 8), (2, 8)), 0)
CHUNKS = [(12, 1, "a"), (10, 2, "b"), (14, 3, "c")]  # (tokens, seed, id): the same chunks in every process


def text(n: int, seed: int, id: str) -> wk.Chunk:
    g = torch.Generator().manual_seed(seed)
    return wk.Chunk.text(torch.randint(10, 128, (n,), generator=g), id=id)


def reference_logits(be, chunks) -> torch.Tensor:
    """transformers' own forward over [chunks · query]: the re-prefill ground truth."""
    ids = torch.cat([c.input_ids for c in chunks] + [QUERY])
    with torch.no_grad():
        return be.model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).logits[0, -1].float()


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


@pytest.fixture(scope="module")
def be():
    torch.set_num_threads(1)
    return wk.HFBackend(build("tiny-qwen2"))


@pytest.fixture(scope="module")
def mc():
    """One loopback Mooncake Store (master + a 256 MiB holder) for the module's tests that do not stop it."""
    with LocalMooncake(segment_bytes=256 << 20) as m:
        yield m
