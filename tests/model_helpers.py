"""Shared test helpers: random text chunks for a backend, and the model's own forward as ground truth."""
from __future__ import annotations

import pytest
import torch

import windowkit as wk
from windowkit.backends.tiny import build


@pytest.fixture(scope="module")
def llama():
    return wk.HFBackend(build("tiny-llama"))


@pytest.fixture(scope="module")
def mla():
    return wk.HFBackend(build("tiny-deepseek-v3"))


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen2.5-VL (vision-language) model of the agent tests, built once per module."""
    torch.set_num_threads(1)
    return build("tiny-qwen2.5-vl")


def text(be, n, seed, id=None):
    """An ``n``-token random text chunk (seeded) within the backend's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return wk.Chunk.text(torch.randint(10, be.vocab_size, (n,), generator=g), id=id or f"c{seed}")


def reference_logits(be, chunks, query, prefix=None):
    """The model's own forward over [prefix · chunks · query] (ground truth)."""
    parts = ([prefix.input_ids] if prefix is not None else []) + [c.input_ids for c in chunks] + [torch.as_tensor(query)]
    ids = torch.cat(parts)
    with torch.no_grad():
        out = be.model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None])
    return out.logits[0, -1].float()
