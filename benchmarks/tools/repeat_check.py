"""Do the Gluon kernel's launch configs give the same output at every call? Each named config
runs ``--calls`` times over one cache, its split partials poisoned with NaN before each call;
per config this reports the largest difference between calls, which (split, KV head) partials
differed, the error against the float64 reference, and the CTAs per SM its registers and shared
memory allow. The configs:

    default         configs.gluon_decode_config(key axis): 2 CTAs per SM; channel-wise K takes
                    two-page tiles, which release their ring stage after the tile's last product
    1cta            the default at 1 CTA per SM (no maxnreg, consumers 232 registers): channel-
                    wise K's config before the late release
    one-page        one-page tiles at 2 CTAs per SM (their stage released before the products)
    one-page-alone  the one-page config with 16 (INT2) or 8 (INT4) ring stages per consumer:
                    the shared memory of one CTA per SM, the same code without a second CTA
                    beside it

GPU only (Hopper). From the repository root:

    python benchmarks/tools/repeat_check.py [--pairs channel/token channel/channel] [--bits 2]
        [--batch 1 8] [--lengths 32768] [--calls 20] [--configs default one-page] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import warnings

import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.backends import combine, gluon
from foscar.configs import gluon_decode_config, gluon_num_splits
from foscar.reference import attend_dequantized
from foscar.results import results_json

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
THREADS = 384  # 12 warps: two consumer warpgroups and the producer's


def configs(key_axis: str, bits: int = 2) -> dict:
    base = gluon_decode_config(key_axis)
    one_page = dataclasses.replace(base, tile_pages=1, stages_per_consumer=4)
    return {
        "default": base,
        "1cta": dataclasses.replace(
            base, maxnreg=None, consumer_regs=232, producer_regs=40, ctas_per_sm=1
        ),
        "one-page": one_page,
        "one-page-alone": dataclasses.replace(  # ring stages of 5 (INT2) / 9 KiB (INT4)
            one_page, stages_per_consumer=16 if bits == 2 else 8, ctas_per_sm=1
        ),
    }


@functools.cache
def ctas_per_sm(cfg, fmt, heads_per_kv: int) -> int:
    """What the compiled kernel's registers and shared memory allow."""
    kernel = gluon.compile_sm90(
        cfg,
        heads_per_kv=heads_per_kv,
        k_bits=fmt.key.bits,
        v_bits=fmt.value.bits,
        v_channel=fmt.value.axis.value == "channel",
        k_channel=fmt.key.axis.value == "channel",
    )
    if torch.cuda.is_available():
        kernel._init_handles()  # loads it: n_regs is the launch's register count
        regs = kernel.n_regs
    else:  # without maxnreg ptxas takes what 384 threads may have
        regs = cfg.maxnreg or REGISTERS_PER_SM // THREADS // 8 * 8
    by_regs = REGISTERS_PER_SM // (regs * THREADS)
    by_smem = SHARED_PER_SM // (kernel.metadata.shared + 1024)
    return min(by_regs, by_smem)


def build(fmt, lengths, num_kv_heads, head_dim, seed=0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = sum(math.ceil((n + 2) / 64) for n in lengths) + 2
    cache = QuantizedKVCache(
        fmt, num_kv_heads=num_kv_heads, head_dim=head_dim, num_pages=pages,
        max_seqs=len(lengths), device=device,
    )
    ids = [cache.add_sequence() for _ in lengths]
    spread = torch.linspace(0.3, 2.0, head_dim)
    for n, i in zip(lengths, ids):
        k = torch.randn(n, num_kv_heads, head_dim, generator=g) * spread
        v = torch.randn(n, num_kv_heads, head_dim, generator=g) * spread.flip(0)
        cache.append([i], k.to(device), v.to(device), [n])
    return cache, cache.plan(ids)


def repeat(q, cache, batch, cfg, splits, ref, calls) -> dict:
    """``calls`` launches of ``cfg`` at ``splits`` splits, the partials poisoned with NaN before
    each: the largest difference between calls, the worst and best error against ``ref``, and
    which (split, KV head) partials differed from the first call's (where the difference starts)."""
    b, hq, d = q.shape
    plan = gluon.GluonDecodePlan(cache, batch, hq, 1 / math.sqrt(d), config=cfg, splits=splits)
    ((o_part, lse_part),) = plan.workspace.tensors()  # allocated when the plan is made
    parts = o_part.shape[2]
    hkv = cache.num_kv_heads
    outs, partials = [], []
    for _ in range(calls):
        out = torch.full_like(q, float("nan"))
        o_part.fill_(float("nan"))
        lse_part.fill_(float("nan"))
        plan.run(q, out=out)
        outs.append(out.float())
        partials.append((o_part.clone(), lse_part.clone()))
    torch.cuda.synchronize()
    stack = torch.stack(outs)
    per_call = (stack - stack[0]).abs().amax(dim=(1, 2, 3))
    err = (stack.double() - ref).abs().amax(dim=(1, 2, 3))
    differing = set()
    for o, lse in partials[1:]:
        o0, lse0 = partials[0]
        bad = ((o - o0).abs().amax(dim=3) > 0) | ((lse - lse0).abs() > 0)  # [B, Hq, parts]
        bad = bad.reshape(b, hkv, hq // hkv, parts).any(dim=2)
        differing |= {(int(s), int(h)) for _, h, s in bad.nonzero().tolist()}
    return {
        "max_diff_between_calls": per_call.max().item(),
        "calls_differing": int((per_call > 0).sum().item()),
        "nan_outputs": int(stack.isnan().any(dim=(1, 2, 3)).sum().item()),
        "worst_error": err.max().item(),
        "best_error": err.min().item(),
        "differing_partials": sorted(differing)[:12],
        "differing_partial_count": len(differing),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", default=["channel/token", "channel/channel"],
                    help="K/V group axes, e.g. channel/token")
    ap.add_argument("--bits", type=int, nargs="+", default=[2], choices=[2, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--configs", nargs="+", default=["default", "1cta", "one-page"],
                    choices=list(configs("token")))
    ap.add_argument("--splits", type=int, nargs="+", default=None,
                    help="split counts to launch every config at (default: each config's rule)")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    hq, hkv, d = 32, 8, 128
    sms = combine.num_sms(0)
    rows = []
    warnings.simplefilter("ignore", RuntimeWarning)  # the one-page configs' repeatability warning
    for pair in args.pairs:
        k_axis, v_axis = pair.split("/")
        for bits in args.bits:
            table = configs(k_axis, bits)
            fmt = KVFormat(QuantFormat(bits, k_axis, 128), QuantFormat(bits, v_axis, 128))
            print(f"format {fmt.key.short()} / {fmt.value.short()}, {args.calls} calls a config")
            for b in args.batch:
                for n in args.lengths:
                    cache, batch = build(fmt, [n] * b, hkv, d)
                    q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(1))
                    q = q.cuda().to(torch.bfloat16)
                    ref, _ = attend_dequantized(q, cache, batch, None, torch.float64)
                    for name in args.configs:
                        cfg = table[name]
                        auto = gluon_num_splits(b, hkv, batch.split_history, cfg, sms)
                        for splits in args.splits or [auto]:
                            row = {"format": f"{fmt.key.short()}/{fmt.value.short()}",
                                   "config": name, "batch": b, "length": n, "splits": splits,
                                   "ctas_per_sm": ctas_per_sm(cfg, fmt, hq // hkv),
                                   **repeat(q, cache, batch, cfg, splits, ref, args.calls)}
                            rows.append(row)
                            print("  " + " ".join(
                                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in row.items() if k != "format"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(results_json({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
