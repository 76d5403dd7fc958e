"""``foscar bench``: decode latency beside FlashInfer on one GPU (:mod:`foscar.bench.grid`), or
with ``--e2e`` end-to-end decode throughput of a Qwen3-8B-shaped model (:mod:`foscar.bench.e2e`);
``--serve`` a seeded request trace through the continuous-batching engine
(:mod:`foscar.serving.bench`, CPU or GPU); ``--replot`` redraws a grid results file's table
and plot without a GPU."""

from __future__ import annotations

import argparse
import math
import sys

from . import serve
from .options import existing_file, nonnegative_int, output_folder, positive_float, positive_int

HELP = (
    "decode latency beside FlashInfer on a GPU (paper grid); --e2e: end-to-end decode; "
    "--serve: continuous-batching serving"
)


def _head_dim(text: str) -> int:
    value = positive_int(text)
    if value % 16 or value > 256:
        raise argparse.ArgumentTypeError(f"expected a multiple of 16 up to 256, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench import e2e, grid

    parser.add_argument(
        "--grid",
        choices=grid.GRIDS,
        default="main",
        help="main: the 13-point grid, token-wise K/V; axes: the four axis combinations at "
        "B in {1,8}, L in {32K,128K}; both; quick: 2 points (default main)",
    )
    parser.add_argument(
        "--axes",
        choices=["token", "all"],
        default="token",
        help="'all' is the same as --grid axes (default token)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=grid.METHODS,
        default=list(grid.DEFAULT_METHODS),
        metavar="METHOD",
        help="methods to time, of: " + ", ".join(grid.METHODS) + " (default: all of them)",
    )
    parser.add_argument(
        "--bits",
        type=int,
        nargs="+",
        choices=[2, 4],
        default=[2, 4],
        help="bit widths of foscar's formats (default 2 4)",
    )
    parser.add_argument(
        "--head-dim",
        type=_head_dim,
        default=128,
        help="head_dim of every method (H_Q=32, H_KV=8); foscar's groups: min(head_dim, 128) "
        "(default 128)",
    )
    parser.add_argument(
        "--page-size",
        type=int,
        choices=[16, 32, 64, 128, 256],
        default=64,
        help="tokens per cache page, of foscar's caches and FlashInfer's (default 64)",
    )
    parser.add_argument(
        "--iters",
        type=positive_int,
        default=30,
        help="timed calls per method and point; the median is reported (default 30)",
    )
    parser.add_argument(
        "--out",
        type=output_folder,
        default=".",
        help="folder of the result files (JSON, markdown, PNG; default: the current folder)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="result file stem (default: decode_grid, decode_axes or decode_quick, with "
        "_d<head_dim> and _p<page_size> when not 128 and 64; --e2e: e2e_qwen3_8b)",
    )
    parser.add_argument(
        "--replot",
        metavar="JSON",
        type=existing_file,
        default=None,
        help="redraw the table and plot of a grid results file (no GPU needed) and exit",
    )
    g = parser.add_argument_group("end-to-end serving benchmark (--e2e)")
    g.add_argument(
        "--e2e",
        action="store_true",
        help="decode throughput of a Qwen3-8B-shaped model (random weights) instead of the "
        "kernel grid; needs a CUDA GPU and transformers",
    )
    g.add_argument(
        "--e2e-contexts",
        type=positive_int,
        nargs="+",
        default=[32768, 102400],
        metavar="L",
        help="prompt lengths in tokens (default 32768 102400)",
    )
    g.add_argument(
        "--e2e-batches",
        type=positive_int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32],
        metavar="B",
        help="batch sizes, users decoding together (default 1 2 4 8 16 32)",
    )
    g.add_argument(
        "--e2e-new-tokens", type=positive_int, default=1024, help="timed decode steps (1024)"
    )
    g.add_argument(
        "--e2e-warmup", type=nonnegative_int, default=8, help="untimed decode steps first (8)"
    )
    g.add_argument(
        "--e2e-methods",
        nargs="+",
        choices=e2e.METHODS,
        default=list(e2e.DEFAULT_METHODS),
        metavar="METHOD",
        help="methods, of: " + ", ".join(e2e.METHODS) + " (default: all but foscar-oscar-*)",
    )
    g.add_argument(
        "--e2e-kv-budget-gib",
        type=positive_float,
        default=96.0,
        help="KV memory budget of the largest-batch table, GiB (default 96)",
    )
    g.add_argument(
        "--e2e-layers",
        type=positive_int,
        default=None,
        help="fewer layers than 36 (smoke runs only)",
    )
    g.add_argument(
        "--e2e-max-seconds",
        type=positive_float,
        default=None,
        help="start no new point after this many seconds (partial results are kept)",
    )
    serve.add_bench_serve_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench import e2e, grid

    if args.replot:
        print(f"wrote {grid.replot(args.replot)}")
        return 0
    if args.serve:
        return serve.run_bench_serve(args)
    if not torch.cuda.is_available():
        what = "--e2e" if args.e2e else "the kernel grid"
        raise ValueError(
            f"{what} needs a CUDA GPU, and torch {torch.__version__} sees none (--replot "
            "redraws a results file without one)"
        )
    if args.e2e:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ValueError("--e2e needs transformers: pip install 'foscar[hf]'") from None
        result = e2e.run_e2e(
            contexts=args.e2e_contexts,
            batches=args.e2e_batches,
            new_tokens=args.e2e_new_tokens,
            warmup=args.e2e_warmup,
            methods=args.e2e_methods,
            kv_budget_gib=args.e2e_kv_budget_gib,
            layers=args.e2e_layers,
            max_seconds=args.e2e_max_seconds,
            out_dir=args.out,
            name=args.name or "e2e_qwen3_8b",
            out=sys.stdout,
        )
        finite = all(math.isfinite(p.get("tpot_ms", 0.0)) for p in result["points"])
        return 0 if finite else 1
    grid.run_grids(
        "axes" if args.axes == "all" else args.grid,
        methods=args.methods,
        bits=args.bits,
        iters=args.iters,
        head_dim=args.head_dim,
        page_size=args.page_size,
        out_dir=args.out,
        name=args.name,
    )
    return 0
