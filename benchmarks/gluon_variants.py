"""Gluon kernel launch variants beside FlashInfer BF16, in one process (H200).

Times ``foscar.backends.gluon.decode`` with explicit configs (``configs.GluonDecodeConfig``; the
names in ``VARIANTS``, and ``triton`` for the Triton kernel) at the main grid's 13 points
(token-wise K and V, INT2 and INT4), with ``--points axes`` at the axes grid's 4 points for the
other K/V axis pairs, with ``--points large`` at B in {1, 8, 64}, L = 128K; FlashInfer BF16 once
per point. Writes JSON rows (one per variant, format and point) and a markdown table of
microseconds and speedups.

    python benchmarks/gluon_variants.py --out DIR [--points main|axes|both|large]
        [--bits 2 4] [--variants tp1 tp2 ...] [--repeat-check [VARIANT ...]]

``--repeat-check`` decodes INT2 K channel-wise, V token-wise at the 32K paper shape 6 times per
variant and reports the worst error against fp64 and the spread between calls (the 2-CTA race
of benchmarks/NOTES.md 15).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from foscar import decode_attention  # noqa: E402
from foscar.backends import gluon as gluon_backend  # noqa: E402
from foscar.bench import baselines  # noqa: E402
from foscar.bench.grid import (  # noqa: E402
    AXES_GRID,
    MAIN_GRID,
    SPIN_US,
    Shape,
    foscar_kv_bytes,
    random_cache,
)
from foscar.bench.grid import plot as grid_plot  # noqa: E402
from foscar.bench.timing import L2Flusher, bench_stats  # noqa: E402
from foscar.configs import gluon_decode_config, gluon_packed_config  # noqa: E402
from foscar.formats import KVFormat, QuantFormat  # noqa: E402

VARIANTS = {
    "tp1": lambda axis, bits: gluon_decode_config(axis, tile_pages=1),
    "tp2": lambda axis, bits: gluon_decode_config(axis, tile_pages=2),
    # INT2 pages are 5 KiB: 4 stages of 2 pages per consumer fit 2 CTAs per SM
    "tp2s4": lambda axis, bits: dataclasses.replace(
        gluon_decode_config(axis, tile_pages=2), stages_per_consumer=4 if bits == 2 else 2
    ),
    # the scaled extraction of INT2 operands (kernel OPT 512, in the default since session 6)
    # on and off, on the default config
    "scaled": lambda axis, bits: dataclasses.replace(
        gluon_decode_config(axis), opt=gluon_decode_config(axis).opt | 512
    ),
    "unscaled": lambda axis, bits: dataclasses.replace(
        gluon_decode_config(axis), opt=gluon_decode_config(axis).opt & ~512
    ),
    # E4M3 operands (kernel OPT 1024, backend "gluon-e4m3") at the bf16 path's launch config,
    # and at 3 CTAs per SM (56 registers at launch, consumers 72, producer 24; INT4 with 3 stages
    # per consumer so that three CTAs' rings fit in shared memory): the E4M3 operands need half
    # the registers, and the tile loops keep their 226-229 instructions without local memory
    "e4m3": lambda axis, bits: dataclasses.replace(
        gluon_decode_config(axis), opt=gluon_decode_config(axis).opt | 1024
    ),
    "e4m3-3cta": lambda axis, bits: dataclasses.replace(
        gluon_decode_config(axis),
        opt=gluon_decode_config(axis).opt | 1024,
        maxnreg=56,
        consumer_regs=72,
        producer_regs=24,
        ctas_per_sm=3,
        stages_per_consumer=4 if bits == 2 else 3,
    ),
    # the launch sequence (session 8, NOTES 18): "base" stages Q in the prologue (session 7's),
    # "qc" in each consumer (OPT 2048, the default since); with e4m3-: on E4M3 operands. (At
    # commit 7369d93 OPT 4096 merged the splits in the kernel, "fused" here; slower at B = 1
    # and removed. Its single-split direct write stays, for every variant.)
    **{
        f"{prefix}{name}": (
            lambda axis, bits, add=add, e4=e4: dataclasses.replace(
                gluon_decode_config(axis),
                opt=(gluon_decode_config(axis).opt & ~(2048 | 8192)) | add | e4,
            )
        )
        for prefix, e4 in (("", 0), ("e4m3-", 1024))
        for name, add in (("base", 0), ("qc", 2048), ("qc-pdl", 2048 | 8192))
    },
    # session 9: 5 ring stages per consumer instead of 4 (INT4's 9 KiB stages: 103 KiB of
    # shared memory, still 2 CTAs per SM; 6 would not fit two), bf16 and E4M3 operands
    "s5": lambda axis, bits: dataclasses.replace(gluon_decode_config(axis), stages_per_consumer=5),
    "e4m3-s5": lambda axis, bits: dataclasses.replace(
        gluon_decode_config(axis), opt=gluon_decode_config(axis).opt | 1024, stages_per_consumer=5
    ),
    # half the split count of the default rule (gluon.num_splits reads ctas_per_sm; the launch
    # still fits 2 CTAs per SM): fewer, longer splits and fewer partials to merge at small batch
    "qc-half-splits": lambda axis, bits: dataclasses.replace(
        gluon_decode_config(axis), ctas_per_sm=1
    ),
    "e4m3-qc-half-splits": lambda axis, bits: dataclasses.replace(
        gluon_decode_config(axis), opt=gluon_decode_config(axis).opt | 1024, ctas_per_sm=1
    ),
    # channel-wise K at 2 CTAs/SM (its one-page kernel raced there, NOTES 15)
    "tp2-2cta": lambda axis, bits: gluon_decode_config("token", tile_pages=2),
    # session 10: packed heads (kernel OPT 262144 | 1024: E4M3 two-page tiles, both pages' scores
    # in one [64, 8] tile; configs.gluon_packed_config), and with 3 stages of 2 pages per
    # consumer for INT2 (INT4's 18 KiB stages keep 2: 3 would not fit 2 CTAs per SM)
    "packed": lambda axis, bits: gluon_packed_config(bits, bits),  # bf16 operands
    "e4m3-packed": lambda axis, bits: dataclasses.replace(
        gluon_packed_config(bits, bits), opt=gluon_packed_config(bits, bits).opt | 1024
    ),
    "e4m3-packed-s3": lambda axis, bits: dataclasses.replace(
        gluon_packed_config(bits, bits),
        opt=gluon_packed_config(bits, bits).opt | 1024,
        stages_per_consumer=3 if bits == 2 else 2,
    ),
}


def time_point(fmt, batch, kv_len, variants, flusher):
    shape = Shape()
    cache, plan = random_cache(fmt, batch, kv_len, shape, "cuda")
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sm = shape.head_dim**-0.5
    res = {}
    for name in variants:
        if name == "triton":  # the Triton kernel, as backend="triton" runs it

            def step(cache=cache, plan=plan):
                return decode_attention(q, cache, plan, sm_scale=sm, backend="triton", out=out)

        else:
            cfg = VARIANTS[name](fmt.key.axis.value, fmt.key.bits)

            def step(cfg=cfg, cache=cache, plan=plan):
                return gluon_backend.decode(q, cache, plan, sm, out=out, config=cfg)

        step()
        torch.cuda.synchronize()
        stats = bench_stats(step, iters=30, warmup=5, flusher=flusher, spin_us=SPIN_US)
        res[name] = stats["median_ms"]
    del cache, plan, step
    baselines.free_cuda_memory()
    return res


def repeat_check(variants):
    """diagnose_channel_k_variants.repeat_check over the named variants' channel-wise K configs."""
    from diagnose_channel_k_variants import repeat_check as repeat_calls

    configs = {name: VARIANTS[name]("channel", 2) for name in variants}
    return repeat_calls(configs, label="KcVt INT2 32K ")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--points", choices=["main", "axes", "both", "large"], default="main")
    ap.add_argument("--variants", nargs="+", default=["tp1", "tp2"])
    ap.add_argument("--bits", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--repeat-check", nargs="*", default=None, metavar="VARIANT")
    ap.add_argument("--name", default="gluon_variants")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plot of a results file")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return
    if not args.out:
        ap.error("--out is required (except with --replot)")
    os.makedirs(args.out, exist_ok=True)
    if args.repeat_check is not None:
        lines = repeat_check(args.repeat_check or ["tp1", "tp2", "tp2-2cta"])
        with open(os.path.join(args.out, args.name + "_repeat.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    jobs = []
    if args.points in ("main", "both"):
        jobs += [("token", "token", b, L) for b, L in MAIN_GRID]
    if args.points == "large":  # three points of the main grid, L = 128K
        jobs += [("token", "token", b, 131072) for b in (1, 8, 64)]
    if args.points in ("axes", "both"):
        for k_axis, v_axis in [("channel", "token"), ("token", "channel"), ("channel", "channel")]:
            jobs += [(k_axis, v_axis, b, L) for b, L in AXES_GRID]
    flusher = L2Flusher(device="cuda")
    shape = Shape()
    rows = []
    fi_us = {}
    for k_axis, v_axis, batch, kv_len in jobs:
        if (batch, kv_len) not in fi_us:
            step, _ = baselines.BASELINES["flashinfer-bf16"](
                batch, kv_len, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, 64, "cuda"
            )
            stats = bench_stats(step, iters=30, warmup=5, flusher=flusher, spin_us=SPIN_US)
            fi_us[batch, kv_len] = 1e3 * stats["median_ms"]
            step.close()
            del step
            baselines.free_cuda_memory()
        for bits in args.bits:
            fmt = KVFormat(QuantFormat(bits, k_axis, 128), QuantFormat(bits, v_axis, 128))
            res = time_point(fmt, batch, kv_len, args.variants, flusher)
            kv_bytes = foscar_kv_bytes(fmt, batch, kv_len, shape)
            for name, ms in res.items():
                rows.append(
                    dict(
                        variant=name,
                        bits=bits,
                        k_axis=k_axis,
                        v_axis=v_axis,
                        batch=batch,
                        kv_len=kv_len,
                        us=1e3 * ms,
                        flashinfer_bf16_us=fi_us[batch, kv_len],
                        tbps=kv_bytes / ms / 1e9,
                    )
                )
            print(
                f"INT{bits} K{k_axis[0]}V{v_axis[0]} B={batch} L={kv_len // 1024}K FI "
                f"{fi_us[batch, kv_len]:.1f} us | "
                + " | ".join(f"{n} {1e3 * ms:.1f} us" for n, ms in res.items()),
                flush=True,
            )
    flusher.free()
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write(markdown(rows, args.variants))
    plot(rows, os.path.join(args.out, args.name + ".png"))
    print(markdown(rows, args.variants))


def plot(rows, path):
    """The speedups over FlashInfer BF16 against context length, a panel per batch, a line per
    variant and format (foscar bench's plot: ``foscar.bench.grid.plot``)."""
    grid_rows = [
        dict(
            method="foscar-gluon " + r["variant"] if r["variant"] != "triton" else "foscar-triton",
            bits=r["bits"],
            k_axis=r["k_axis"],
            v_axis=r["v_axis"],
            batch=r["batch"],
            kv_len=r["kv_len"],
            speedup_vs_flashinfer_bf16=r["flashinfer_bf16_us"] / r["us"],
        )
        for r in rows
    ]
    try:
        grid_plot(grid_rows, path)
    except ImportError:
        print("matplotlib not importable: no plot", file=sys.stderr)


def markdown(rows, variants):
    """Per format and point: microseconds and speedup over FlashInfer BF16 of each variant; the
    geometric mean of the speedups per format and axis pair."""
    lines = [
        "| format | B | L | FlashInfer BF16 us | "
        + " | ".join(f"{v} us (x, % of 4.8 TB/s)" for v in variants)
        + " |",
        "|" + "---|" * (4 + len(variants)),
    ]
    groups = {}
    for r in rows:
        groups.setdefault((r["bits"], r["k_axis"], r["v_axis"], r["batch"], r["kv_len"]), {})[
            r["variant"]
        ] = r
    for (bits, ka, va, b, L), by in groups.items():
        fi = next(iter(by.values()))["flashinfer_bf16_us"]
        cells = []
        for v in variants:
            r = by.get(v)
            cells.append(
                f"{r['us']:.1f} ({fi / r['us']:.2f}x, {100 * r['tbps'] / 4.8:.0f}%)" if r else "-"
            )
        lines.append(
            f"| INT{bits} K{ka[0]}V{va[0]} | {b} | {L // 1024}K | {fi:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("")
    lines.append("Geometric-mean speedup over FlashInfer BF16:")
    lines.append("")
    keys = sorted({(r["bits"], r["k_axis"], r["v_axis"]) for r in rows})
    for bits, ka, va in keys:
        parts = []
        for v in variants:
            sp = [
                r["flashinfer_bf16_us"] / r["us"]
                for r in rows
                if (r["bits"], r["k_axis"], r["v_axis"], r["variant"]) == (bits, ka, va, v)
            ]
            if sp:
                parts.append(f"{v} {math.exp(sum(map(math.log, sp)) / len(sp)):.2f}x")
        lines.append(f"- INT{bits} K{ka[0]}V{va[0]}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
