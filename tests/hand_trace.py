"""The hand-made profile and trace the simulator tests share (every cost on it is worked out by hand in
tests/test_simulate.py).

    from hand_trace import P, A, B, C, T
"""
from windowkit.trace import ChunkRef, CostProfile, Step, Trace

# simple numbers: 1 ms per prefill token, 2 ms per visual token, replay 0.5, patch apply 0.25, SVD 0.125
P = CostProfile(name="unit", source="hand-made for tests", vision_encode_ms_per_token=2.0, prefill_ms_per_token=1.0,
                kv_replay_ms_per_token=0.5, patch_apply_ms_per_token=0.25, patch_form_ms_per_token=0.125,
                kv_bytes_per_token=100, patch_bytes_per_token=10)
A = ChunkRef(id="A", tokens=4, kind="image")
B = ChunkRef(id="B", tokens=2, kind="text")
C = ChunkRef(id="C", tokens=4, kind="image")
# s0 [A B] q1 -> s1 [B C] q1 (A evicted at the head, C admitted) -> s2 [A B C] q0 (A recalled at the head)
T = Trace([Step(step=0, context=[A, B], query_tokens=1), Step(step=1, context=[B, C], query_tokens=1),
           Step(step=2, context=[A, B, C], query_tokens=0)], name="hand")
