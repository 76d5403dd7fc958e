"""Sweep launch configurations of the Triton decode kernel on the GPU (H200).

    python benchmarks/tools/tune_triton.py [--bits 2 4] [--out results.json]

For each (bits, axes, batch, kv_len) point, times the decode step under every
(block_n, num_warps, num_stages) config and split count policy, cold L2, median of 20 calls.
The winners go into foscar/configs.py (``bash benchmarks/run_device.sh tune`` runs it).
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

from foscar.backends import triton as tb
from foscar.bench.grid import Shape, random_cache
from foscar.bench.timing import L2Flusher, bench_stats
from foscar.configs import TritonDecodeConfig, triton_num_splits
from foscar.formats import KVFormat, QuantFormat

ROUNDS = {
    # round 1: block size, warps and cp.async stages
    1: [
        (128, 4, 1, None),
        (128, 4, 2, None),
        (128, 4, 3, None),
        (64, 4, 1, None),
        (64, 4, 2, None),
        (64, 4, 3, None),
        (64, 4, 4, None),
        (128, 8, 2, None),
    ],
    # round 2: occupancy against spills (register caps), larger tiles over 8 warps
    2: [(128, 4, 3, None), (128, 4, 3, 168), (128, 4, 4, None), (256, 8, 2, None), (64, 4, 3, 128)],
    # round 3: split counts that fill the resident CTA slots (the 5th field: CTAs per SM the
    # split count assumes), and 3 CTAs/SM at 64-token tiles without spills (cap 168)
    3: [
        (128, 4, 3, None, 2),
        (128, 4, 3, None, 3),
        (64, 4, 3, 128, 4),
        (64, 4, 3, 128, 6),
        (64, 4, 3, 168, 3),
        (64, 4, 4, 128, 4),
    ],
    # round 4: the split count alone, at the config round 3 kept (use with --splits)
    4: [(64, 4, 3, 128, 4)],
}
POINTS = [(1, 32768), (1, 131072), (8, 32768), (8, 131072), (64, 16384)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--axes", nargs="+", default=["token,token"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--round", type=int, default=2)
    ap.add_argument("--splits", type=int, nargs="*", default=None, help="explicit split counts")
    ap.add_argument("--points", nargs="*", default=None, help="BATCHxKV_LEN, e.g. 8x131072")
    a = ap.parse_args()
    points = [tuple(map(int, p.split("x"))) for p in a.points] if a.points else POINTS
    configs = [
        TritonDecodeConfig(
            block_n=c[0], num_warps=c[1], num_stages=c[2], maxnreg=c[3], ctas_per_sm=c[4]
        )
        if len(c) == 5
        else TritonDecodeConfig(block_n=c[0], num_warps=c[1], num_stages=c[2], maxnreg=c[3])
        for c in ROUNDS[a.round]
    ]
    shape = Shape()
    flusher = L2Flusher()
    rows = []
    for bits in a.bits:
        for axes in a.axes:
            ka, va = axes.split(",")
            fmt = KVFormat(QuantFormat(bits, ka, 128), QuantFormat(bits, va, 128))
            for batch, kv_len in points:
                cache, plan = random_cache(fmt, batch, kv_len, shape, "cuda")
                q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
                out = torch.empty_like(q)
                kv_bytes = batch * kv_len * 8 * (2 * 128 * bits / 8 + 16)
                line = []
                for cfg in configs:
                    if a.splits:
                        tiles = math.ceil(kv_len / cfg.block_n)
                        choices = [s for s in a.splits if s <= tiles]
                    else:
                        scales = (1, 2) if a.round == 1 else (1,)
                        choices = [
                            triton_num_splits(batch, 8, kv_len, cfg, 132 * k) for k in scales
                        ]
                    for splits in choices:
                        try:
                            run = tb.TritonDecodePlan(
                                cache, plan, q.shape[1], 1 / math.sqrt(128), config=cfg,
                                splits=splits,
                            ).run
                            fn = functools.partial(run, q, out=out)
                            fn()
                            ms = bench_stats(fn, iters=20, warmup=3, flusher=flusher, spin_us=300)[
                                "median_ms"
                            ]
                        except Exception as exc:  # a config that does not compile or fit
                            print("fail", cfg, repr(exc)[:200])
                            continue
                        tbps = kv_bytes / ms / 1e9
                        rows.append(
                            {
                                "bits": bits,
                                "axes": axes,
                                "batch": batch,
                                "kv_len": kv_len,
                                "block_n": cfg.block_n,
                                "num_warps": cfg.num_warps,
                                "num_stages": cfg.num_stages,
                                "maxnreg": cfg.maxnreg,
                                "ctas_per_sm": cfg.ctas_per_sm,
                                "splits": splits,
                                "ms": ms,
                                "tbps": tbps,
                            }
                        )
                        line.append(
                            f"{cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}"
                            f"/r{cfg.maxnreg}c{cfg.ctas_per_sm}x{splits}"
                            f":{ms * 1e3:.0f}us({tbps:.2f})"
                        )
                print(
                    f"INT{bits} {axes} B={batch} L={kv_len // 1024}K  " + "  ".join(line),
                    flush=True,
                )
                del cache, plan
                torch.cuda.empty_cache()
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
