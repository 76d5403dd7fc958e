"""Where the ~10 us of fixed cost per Gluon decode call goes at small batch (H200).

At the small grid points the tiles are a fraction of the time (B=1 L=8K: about 2 us of tile work at
the large-batch rate, 11.7 us measured; benchmarks/NOTES.md 18). This script times, per point, the
pieces of one call, each the median of 40 (foscar.bench.timing: a 300 us spin ahead of each call,
as the grids used until session 9, so host launch latency is not timed), with the L2 flushed before
each call (cold, as the grids time) and without a flush (warm: metadata, Q, partials and pages stay
in L2):

- ``empty-1`` / ``empty-grid``: an empty Triton kernel of 1 CTA and of the split grid's CTA
  count: the event-to-event floor of one launch.
- ``whole``: ``gluon.decode`` as shipped (split kernel + dependent-launch merge).
- ``split``: the split kernel alone (the merge replaced by nothing).
- ``split-no-tiles``: the split kernel with every split empty (kernel OPT 16384): launch,
  prologue, the span's loads, Q staging, the epilogue's partial stores.
- ``whole-no-tiles``: the same plus the merge.
- ``split-memory``: consumers only wait and release stages (OPT 32): the producer's path.
- ``merge``: the Triton merge alone on the split workspace (a plain launch).

    python benchmarks/fixed_cost.py [--operands e4m3 bf16] [--out DIR]
    ncu --clock-control none -k regex:"gluon|merge" python benchmarks/fixed_cost.py --once
        (``--once``: the whole call at B=1 L=8K five times, untimed, for a profiler; ncu flushes
        the caches before each kernel by default, so its durations are cold ones)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import triton
import triton.language as tl

from foscar.backends import gluon as gluon_backend
from foscar.backends import triton as triton_backend
from foscar.bench.grid import Shape, random_cache
from foscar.bench.timing import L2Flusher, bench_stats
from foscar.formats import KVFormat, QuantFormat

NO_TILES = 16384
MEMORY_ONLY = 32
POINTS = [(1, 8192), (1, 32768), (1, 131072), (8, 8192)]


@triton.jit
def _empty_kernel(x_ptr):
    if tl.program_id(0) < 0:  # never: keeps the argument live
        tl.store(x_ptr, 0)


def pieces(fmt, batch, kv_len, shape, operands):
    """{name: zero-argument callable} for one point, and the split count."""
    cache, plan = random_cache(fmt, batch, kv_len, shape, "cuda")
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, device="cuda").bfloat16()
    out = torch.empty_like(q)
    sm = shape.head_dim**-0.5
    cfg = gluon_backend.default_config(cache, plan, operands)
    merge = triton_backend.merge_partials
    dummy = torch.zeros(1, device="cuda", dtype=torch.int32)

    def call(opt_bits=0, with_merge=True):
        c = dataclasses.replace(cfg, opt=cfg.opt | opt_bits)

        def fn():
            if not with_merge:
                triton_backend.merge_partials = lambda *a, **k: None
            try:
                return gluon_backend.decode(
                    q, cache, plan, sm, out=out, operands=operands, config=c
                )
            finally:
                triton_backend.merge_partials = merge

        return fn

    call()()
    (ws,) = plan.__dict__["_workspaces"].values()
    splits = ws[0].shape[2]
    grid = batch * shape.num_kv_heads * splits
    fns = {
        "empty-1": lambda: _empty_kernel[(1,)](dummy),
        "empty-grid": lambda: _empty_kernel[(grid,)](dummy),
        "whole": call(),
        "split": call(with_merge=False),
        "split-no-tiles": call(NO_TILES, with_merge=False),
        "whole-no-tiles": call(NO_TILES),
        "split-memory": call(MEMORY_ONLY, with_merge=False),
        "merge": lambda: merge(ws[0], ws[1], out),
    }
    return fns, splits, cache, plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--operands", nargs="+", default=["e4m3", "bf16"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--once", action="store_true")
    args = ap.parse_args()
    shape = Shape()
    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
    if args.once:
        for operands in args.operands:
            fns, *_ = pieces(fmt, *POINTS[0], shape, operands)
            for _ in range(5):
                fns["whole"]()
            torch.cuda.synchronize()
        return
    flusher = L2Flusher(device="cuda")
    rows = []
    lines = [
        "| operands | B | L | splits | piece | cold us | warm us |",
        "|---|---|---|---|---|---|---|",
    ]
    for operands in args.operands:
        for batch, kv_len in POINTS:
            fns, splits, cache, plan = pieces(fmt, batch, kv_len, shape, operands)
            for name, fn in fns.items():
                fn()
                torch.cuda.synchronize()
                us = {}
                for label, fl in (("cold", flusher), ("warm", None)):
                    st = bench_stats(
                        fn, iters=40, warmup=5, flush=fl is not None, flusher=fl, spin_us=300
                    )
                    us[label] = 1e3 * st["median_ms"]
                row = dict(operands=operands, B=batch, L=kv_len, splits=splits, piece=name, **us)
                rows.append(row)
                line = (
                    f"| {operands} | {batch} | {kv_len // 1024}K | {splits} | {name} | "
                    f"{us['cold']:.1f} | {us['warm']:.1f} |"
                )
                lines.append(line)
                print(line, flush=True)
            del fns, cache, plan
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fixed_cost.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "fixed_cost.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
