"""Errors against fp64 at the 32K paper shape, per backend and K/V axes (the Gluon channel-wise K
bar check, session 5): prints rel L2 of Gluon, Triton and bf16 torch attention for each case.

    python benchmarks/diagnose_channel_k.py
"""

import sys

sys.path.insert(0, "tests")
from kernel_cases import bf16_torch_attention, build_cache, queries, rel_l2  # noqa: E402

from foscar import KVFormat, QuantFormat, decode_attention  # noqa: E402
from foscar.reference import attend_dequantized  # noqa: E402

for bits in (2, 4):
    for k_axis, v_axis in (
        ("token", "token"),
        ("token", "channel"),
        ("channel", "token"),
        ("channel", "channel"),
    ):
        fmt = KVFormat(QuantFormat(bits, k_axis, 128), QuantFormat(bits, v_axis, 128))
        cache, batch = build_cache(fmt, (32768, 4099), num_kv_heads=8, device="cuda", seed=bits)
        q = queries(batch, 32, 128, "cuda")
        sm = 128**-0.5
        ref, _ = attend_dequantized(q.double(), cache, batch, sm)
        errs = {"bf16-torch": rel_l2(bf16_torch_attention(q, cache, batch, sm), ref)}
        for backend in ("gluon", "triton"):
            errs[backend] = rel_l2(decode_attention(q, cache, batch, backend=backend), ref)
        # a race shows as outputs that change from call to call: five more calls, each sequence
        runs = [decode_attention(q, cache, batch, backend="gluon") for _ in range(5)]
        per_seq = [max(rel_l2(o[i], ref[i]) for o in runs) for i in (0, 1)]
        print(
            f"INT{bits} K{k_axis[0]}V{v_axis[0]}",
            {k: f"{v:.2e}" for k, v in errs.items()},
            "gluon worst of 5 per seq",
            [f"{e:.2e}" for e in per_seq],
            flush=True,
        )
