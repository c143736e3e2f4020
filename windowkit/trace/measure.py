"""Measure a cost profile on this machine with windowkit's tiny random models (how ``cpu-tiny`` was made).

    from windowkit.trace.measure import measure_profile
    prof = measure_profile()                 # ~10 s on one CPU core
    prof.save("windowkit/trace/profiles/cpu-tiny.json")

What is timed (median of ``repeats`` runs after a warm-up, single thread, fp32):
  prefill      HFBackend(tiny-qwen2).forward of one ``tokens``-token text chunk at position 0
  kv replay    ChunkKV.relocate of that chunk's KV by 1000 positions (exact per-token angles)
  patch apply  place(canonical, δ, rope, rank-32 patch) minus place(canonical, δ, rope, None)
  patch form   form_patch (exact SVD, rank 32) of the conditioned vs canonical KV
  vision       HFBackend(tiny-qwen2.5-vl).embeds of a synthetic image chunk (vision tower), per visual token
Bytes per token come from the tiny model's layout (fp32) and the rank-32 patch factor size.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from windowkit.backends import tiny
from windowkit.backends.hf import HFBackend
from windowkit.chunk import Chunk
from windowkit.kv.patch import form_patch, place
from windowkit.trace.costs import CostProfile


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def measure_profile(model: str = "tiny-qwen2", vl_model: str = "tiny-qwen2.5-vl", tokens: int = 512, rank: int = 32,
                    repeats: int = 5, threads: int = 1) -> CostProfile:
    """Time the operations the simulator charges on tiny models; returns a ``cpu-tiny`` CostProfile."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        be = HFBackend(tiny.build(model))
        g = torch.Generator().manual_seed(0)
        a = Chunk.text(torch.randint(10, 100, (tokens,), generator=g), id="a")
        b = Chunk.text(torch.randint(10, 100, (tokens,), generator=g), id="b")
        canon = be.forward([b], 0).kv
        kv_a = be.forward([a], 0).kv
        cond = be.forward([b], tokens, kv_a).kv
        prefill = _median_ms(lambda: be.forward([b], 0), repeats) / tokens
        replay = _median_ms(lambda: canon.relocate(1000, be.rope), repeats) / tokens
        patch = form_patch(cond, canon, tokens, be.rope, rank)
        form = _median_ms(lambda: form_patch(cond, canon, tokens, be.rope, rank), repeats) / tokens
        with_p = _median_ms(lambda: place(canon, 1000, be.rope, patch), repeats)
        without = _median_ms(lambda: place(canon, 1000, be.rope, None), repeats)
        apply = max(with_p - without, 0.0) / tokens
        vl = tiny.build(vl_model)
        vbe = HFBackend(vl)
        img = tiny.synthetic_image_chunk(vl, grid=(1, 16, 16), id="img")
        n_vis = int((img.input_ids == vl.config.image_token_id).sum())

        def _vision() -> None:
            vbe.forget(img)
            vbe.embeds(img)

        vision = _median_ms(_vision, repeats) / n_vis
        lay = be.layout
        kvb = lay.num_layers * sum(h * d for h, d in lay.slot_shapes) * 4
        pb = lay.num_layers * 2 * rank * 4  # the U side of both slots, fp32 (V is per chunk, not per token)
    finally:
        torch.set_num_threads(old_threads)
    return CostProfile(
        name="cpu-tiny", device=f"CPU, {threads} thread(s), torch {torch.__version__}",
        source=(f"measured with windowkit.trace.measure.measure_profile(model={model!r}, vl_model={vl_model!r}, "
                f"tokens={tokens}, rank={rank}, repeats={repeats}, threads={threads}): median wall time per token of "
                "HFBackend forward (prefill), ChunkKV.relocate (replay), place with minus without a patch (apply), "
                "form_patch (SVD) and the VL vision tower (per visual token); linear per-token scaling assumed"),
        vision_encode_ms_per_token=vision, prefill_ms_per_token=prefill, kv_replay_ms_per_token=replay,
        patch_apply_ms_per_token=apply, patch_form_ms_per_token=form, kv_bytes_per_token=kvb,
        patch_bytes_per_token=pb,
        notes=f"tiny random models (4 layers, hidden 128); {n_vis} visual tokens per measured image")


if __name__ == "__main__":  # python -m windowkit.trace.measure [out.json]
    import sys

    p = measure_profile()
    print(p)
    if len(sys.argv) > 1:
        p.save(sys.argv[1])
