"""Are the channel-wise formats' slow calls (benchmarks/NOTES.md 16 and 19) the kernels' or the
host's? Times the axes grid's B=1 points of token-wise K and V and the three channel-wise pairs
(INT2 and INT4, Gluon default config) with the grids' 300 us GPU spin ahead of each call, with a
3000 us spin, and as CUDA-graph replays (no host launch in the timed region at all), each the
median / p10 / p90 of 60 calls with the L2 flushed; and the host time to enqueue one call (its
kernels, not awaited). Channel-wise formats launch three kernels per call (the split kernel, the
Triton window program for the BF16 tail, the merge), token-wise K and V two or one.

    python benchmarks/tail_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from foscar import decode_attention
from foscar.bench.grid import Shape, random_cache
from foscar.bench.timing import L2Flusher, bench_stats
from foscar.formats import KVFormat, QuantFormat

PAIRS = [("token", "token"), ("token", "channel"), ("channel", "token"), ("channel", "channel")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape = Shape()
    flusher = L2Flusher(device="cuda")
    rows, lines = [], []
    head = "| format | B | L | host enqueue us (median / max) | spin 300 | spin 3000 | graph |"
    lines += [head, "|---|---|---|---|---|---|---|"]
    print(head, flush=True)
    for bits in (2, 4):
        for k_axis, v_axis in PAIRS:
            fmt = KVFormat(QuantFormat(bits, k_axis, 128), QuantFormat(bits, v_axis, 128))
            for kv_len in (32768, 131072):
                cache, plan = random_cache(fmt, 1, kv_len, shape, "cuda")
                q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
                out = torch.empty_like(q)

                def step(cache=cache, plan=plan, q=q, out=out):
                    return decode_attention(q, cache, plan, backend="gluon", out=out)

                step()
                torch.cuda.synchronize()
                host = []
                for _ in range(30):
                    torch.cuda._sleep(2_000_000)  # keep the GPU busy: host time only
                    t0 = time.perf_counter()
                    step()
                    host.append((time.perf_counter() - t0) * 1e6)
                    torch.cuda.synchronize()
                res = {}
                for name, kw in (
                    ("spin300", dict(spin_us=300)),
                    ("spin3000", dict(spin_us=3000)),
                    ("graph", dict(spin_us=300, cuda_graph=True)),
                ):
                    st = bench_stats(step, iters=60, warmup=5, flusher=flusher, **kw)
                    res[name] = [1e3 * st[k] for k in ("median_ms", "p10_ms", "p90_ms")]
                row = dict(
                    bits=bits,
                    k_axis=k_axis,
                    v_axis=v_axis,
                    L=kv_len,
                    host_us=[statistics.median(host), max(host)],
                    **res,
                )
                rows.append(row)
                cell = lambda v: f"{v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f})"  # noqa: E731
                line = (
                    f"| INT{bits} K{k_axis[0]}V{v_axis[0]} | 1 | {kv_len // 1024}K | "
                    f"{row['host_us'][0]:.0f} / {row['host_us'][1]:.0f} | {cell(res['spin300'])} | "
                    f"{cell(res['spin3000'])} | {cell(res['graph'])} |"
                )
                lines.append(line)
                print(line, flush=True)
                del cache, plan, step
                torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tail_check.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "tail_check.md"), "w") as f:
            f.write("microseconds: median (p10-p90) of 60 calls, L2 flushed\n\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
