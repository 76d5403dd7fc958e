"""What the separate LSE merge launch costs the Gluon decode at small batch (H200).

Times, at the main grid's small points (INT2, token-wise K and V, the paper shape), the whole
``gluon.decode`` call (split kernel + Triton merge), the split kernel alone (the merge replaced by
nothing), and the merge alone on the same workspace, each the median of 30 with L2 flushed
(foscar.bench.timing, a 300 us spin ahead of each call as the grids used until session 9, so that a
call is not host-bound). The difference bounds what fusing the merge into the split kernel (the
last CTA of a row merges) could save.

    python benchmarks/merge_cost.py [--operands e4m3|bf16]
"""

from __future__ import annotations

import argparse

import torch

from foscar.backends import gluon as gluon_backend
from foscar.backends import triton as triton_backend
from foscar.bench.grid import Shape, random_cache
from foscar.bench.timing import L2Flusher, bench_stats
from foscar.formats import KVFormat, QuantFormat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--operands", default="e4m3", choices=gluon_backend.OPERANDS)
    args = ap.parse_args()
    shape = Shape()
    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
    flusher = L2Flusher(device="cuda")
    print(f"operands {args.operands}; microseconds, median of 30, L2 flushed")
    print("| B | L | splits | whole call | split kernel alone | merge alone |")
    print("|---|---|---|---|---|---|")
    for batch, kv_len in [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768)]:
        splits, us = time_point(fmt, batch, kv_len, shape, args.operands, flusher)
        print(
            f"| {batch} | {kv_len // 1024}K | {splits} | "
            + " | ".join(f"{u:.1f}" for u in us)
            + " |"
        )
        torch.cuda.empty_cache()


def time_point(fmt, batch, kv_len, shape, operands, flusher):
    """(splits, [whole call, split kernel alone, merge alone] in microseconds)."""
    merge = triton_backend.merge_partials
    cache, plan = random_cache(fmt, batch, kv_len, shape, "cuda")
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, device="cuda").bfloat16()
    out = torch.empty_like(q)
    sm = shape.head_dim**-0.5

    def whole():
        return gluon_backend.decode(q, cache, plan, sm, out=out, operands=operands)

    def split_only():
        triton_backend.merge_partials = lambda *a, **k: None
        try:
            return gluon_backend.decode(q, cache, plan, sm, out=out, operands=operands)
        finally:
            triton_backend.merge_partials = merge

    whole()
    (ws,) = plan.__dict__["_workspaces"].values()

    def merge_only():
        return merge(ws[0], ws[1], out)

    us = []
    for fn in (whole, split_only, merge_only):
        fn()
        torch.cuda.synchronize()
        us.append(
            1e3 * bench_stats(fn, iters=30, warmup=5, flusher=flusher, spin_us=300)["median_ms"]
        )
    return ws[0].shape[2], us


if __name__ == "__main__":
    main()
