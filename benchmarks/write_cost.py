"""What a decode step's cache write costs an OSCAR layer: fused against torch (H200).

OSCAR's layers clip each token at a fitted percentile and may round keys by GPTQ; until session
12 such a layer took the torch writer (``decode_write="torch"``: ~60 tensor operations per role,
plus 5 per channel for GPTQ's rounding loop), now the fused Triton write. This times one
``QuantizedKVCache.append`` of a decode step (one token per sequence, one layer, wall time of
the call with the GPU synchronised after it, median of 50 after 5 warm-up steps) for:

* ``plain fused``: INT2 token-wise, no clip, no GPTQ (the fused write as before);
* ``OSCAR fused``: the same with K and V clipped (0.85 / 0.92) and GPTQ keys;
* ``OSCAR torch``: that layer through the torch writer.

Every sequence holds ``--prefill`` tokens first (so a step demotes one token per sequence out of
the 64/256 windows). Shapes: SmolLM2-135M's KV heads (3 x 64) and an 8 x 128 model.

    python benchmarks/write_cost.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.quantize import gptq_factor


def make_cache(heads, dim, batch, prefill, oscar, path, gen):
    g = min(dim, 128)
    fmt = KVFormat(
        QuantFormat(2, "token", g), QuantFormat(2, "token", g), sink_tokens=64, recent_tokens=256
    )
    pages = batch * ((prefill + 200) // 64 + 2)
    cache = QuantizedKVCache(
        fmt,
        num_kv_heads=heads,
        head_dim=dim,
        num_pages=pages,
        max_seqs=batch,
        page_size=64,
        device="cuda",
        decode_write=path,
    )
    if oscar:
        a = torch.randn(heads, dim, dim, generator=gen, dtype=torch.float64)
        factor = gptq_factor(a @ a.transpose(-1, -2) / dim + torch.eye(dim, dtype=torch.float64))
        cache.set_transform(0, key_clip=0.85, value_clip=0.92, key_gptq=factor)
    ids = [cache.add_sequence() for _ in range(batch)]
    x = torch.randn(batch * prefill, heads, dim, generator=gen).to("cuda", torch.bfloat16)
    cache.append(ids, x, x, [prefill] * batch)
    return cache, ids


def time_steps(cache, ids, heads, dim, steps=50, warmup=5):
    """Median microseconds of one decode-step append (host + GPU), and the steps' tokens."""
    batch = len(ids)
    xs = torch.randn(steps + warmup, 2, batch, heads, dim, device="cuda").bfloat16()
    times = []
    for i in range(steps + warmup):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.append(ids, xs[i, 0], xs[i, 1])
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print("| KV heads x head_dim | batch | plain fused | OSCAR fused | OSCAR torch | same bits |")
    print("|---|---|---|---|---|---|")
    for heads, dim in [(3, 64), (8, 128)]:
        for batch in [1, 32]:
            us = {}
            snaps = {}
            for name, oscar, path in [
                ("plain fused", False, "fused"),
                ("OSCAR fused", True, "fused"),
                ("OSCAR torch", True, "torch"),
            ]:
                gen = torch.Generator().manual_seed(0)
                cache, ids = make_cache(heads, dim, batch, args.prefill, oscar, path, gen)
                torch.manual_seed(1)  # the same step tokens for both OSCAR paths
                us[name] = time_steps(cache, ids, heads, dim)
                snaps[name] = [t.clone() for t in cache.layers[0].tensors().values()]
                del cache
            same = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(snaps["OSCAR fused"], snaps["OSCAR torch"])
            )
            rows.append({"heads": heads, "head_dim": dim, "batch": batch, "us": us, "same": same})
            print(
                f"| {heads} x {dim} | {batch} | "
                + " | ".join(f"{us[n]:.0f} us" for n in us)
                + f" | {same} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prefill": args.prefill, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
