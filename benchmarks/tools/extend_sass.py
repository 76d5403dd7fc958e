"""Compile the extend kernel (foscar.kernels.triton_extend) for sm_90a on any machine (no GPU
needed) and print each config's registers, stack (spills), shared memory and compile time:

    python benchmarks/tools/extend_sass.py [--formats int2 int4 kivi2] [--ratio 4] [--default-only]
    python benchmarks/tools/extend_sass.py --every-format [--head-dim 128] [--jobs 2] [-k Kt32]

Uses triton's bundled ptxas (as benchmarks/tools/sass_count.py). The configs are
extend_bench.py's sweep plus the default of each format; ``--every-format`` compiles the default
config (``extend_config``) of every K/V axis pair, K group of 32, 64 and 128 tokens or channels
and V group of 32 and 128, at INT2 K and INT4 V, so that no format a user can serve compiles for
minutes on its first chunk (every one of them: 3-8 s of one core).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
from extend_bench import SWEEP, formats  # noqa: E402
from sass_count import DECODE_POINTERS, compile_sm90, resources  # noqa: E402

from foscar.backends.combine import has_window_program  # noqa: E402
from foscar.backends.extend import ExtendConfig, extend_config, query_columns  # noqa: E402
from foscar.configs import column_widths  # noqa: E402
from foscar.formats import KVFormat, QuantFormat  # noqa: E402
from foscar.kernels import triton_extend as kern  # noqa: E402

#: the decode split kernel's pointers (the same pool, windows and partials), and the chunk's
POINTERS = {**DECODE_POINTERS, "k_chunk_ptr": "*bf16", "v_chunk_ptr": "*bf16", "o_ptr": "*bf16"}


def compile_extend(fmt, cfg: ExtendConfig, *, head_dim=128, ratio=4, page=64, direct=True):
    hs = query_columns(cfg, ratio)
    _, hpk, hpv = column_widths(fmt, head_dim, hs, cfg.block_n, False)
    consts = dict(
        H=ratio, BLOCK_T=cfg.block_t, HS=hs, D=head_dim, PAGE=page, BLOCK_N=cfg.block_n,
        K_BITS=fmt.key.bits, V_BITS=fmt.value.bits, K_CHANNEL=fmt.key.axis.value == "channel",
        V_CHANNEL=fmt.value.axis.value == "channel", K_GROUP=fmt.key.group_size,
        V_GROUP=fmt.value.group_size, SINK=fmt.sink_tokens, TAIL=fmt.tail_capacity,
        HAS_WINDOWS=has_window_program(fmt), BLOCK_W=cfg.block_window, HPK=hpk, HPV=hpv,
        DIRECT=direct, ROUND_OUT=True, INTERP=False, TILE_ACC=cfg.tile_acc,
    )  # fmt: skip
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return compile_sm90(kern.extend_kernel, consts, POINTERS, options)


def every_format(head_dim: int) -> dict[str, KVFormat]:
    """Name -> format: every K/V axis pair with K groups 32/64/128 and V groups 32/128."""
    found = {}
    for k_axis, v_axis, k_group, v_group in itertools.product(
        ("token", "channel"), ("token", "channel"), (32, 64, 128), (32, 128)
    ):
        k_group, v_group = min(k_group, head_dim), min(v_group, head_dim)
        fmt = KVFormat(QuantFormat(2, k_axis, k_group), QuantFormat(4, v_axis, v_group),
                       sink_tokens=4, recent_tokens=32)  # fmt: skip
        found[f"K{k_axis[0]}{k_group}-V{v_axis[0]}{v_group}"] = fmt
    return found


def compile_default(job) -> str:
    """One line for ``(name, fmt, head_dim, ratio)``: the default config's resources and its
    compile time."""
    name, fmt, head_dim, ratio = job
    cfg = extend_config(fmt, head_dim, ratio)
    start = time.perf_counter()
    try:
        found = resources(compile_extend(fmt, cfg, head_dim=head_dim, ratio=ratio))
    except Exception as exc:
        return f"{name} d{head_dim} G{ratio}: FAILED {type(exc).__name__}: {str(exc)[:2000]}"
    took = time.perf_counter() - start
    return f"{name} d{head_dim} G{ratio} block_n={cfg.block_n}: {found} compile={took:.1f}s"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["int2", "int4", "kivi2"])
    p.add_argument("--ratio", type=int, default=4, help="query heads per KV head (4)")
    p.add_argument("--default-only", action="store_true", help="extend_config's config only")
    p.add_argument("--every-format", action="store_true",
                   help="the default config of every axis pair and group size")  # fmt: skip
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--jobs", type=int, default=1, help="compile processes (--every-format)")
    p.add_argument(
        "-k", dest="only", default=None, help="--every-format: formats whose name holds this text"
    )
    args = p.parse_args(argv)
    if args.every_format:
        jobs = [
            (n, f, args.head_dim, args.ratio)
            for n, f in every_format(args.head_dim).items()
            if args.only is None or args.only in n
        ]
        failed = 0
        with ProcessPoolExecutor(args.jobs) as pool:
            for line in pool.map(compile_default, jobs):
                print(line, flush=True)
                failed += "FAILED" in line
        return 1 if failed else 0
    failed = 0
    for name in args.formats:
        fmt = formats()[name]
        cfgs = [extend_config(fmt, 128, args.ratio), *([] if args.default_only else SWEEP)]
        for cfg in dict.fromkeys(cfgs):
            try:
                print(f"{name} {cfg}: {resources(compile_extend(fmt, cfg, ratio=args.ratio))}")
            except Exception as exc:
                failed += 1
                print(f"{name} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
