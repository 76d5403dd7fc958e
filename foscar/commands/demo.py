"""``foscar demo``: every KV format on the paper's stress input (:mod:`foscar.demo`)."""

from __future__ import annotations

import argparse

from .options import device, positive_float, positive_int

HELP = "every KV format on the paper's stress input: memory and error (CPU or GPU, < 1 min)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--length", type=positive_int, default=8192, help="context length in tokens (default 8192)"
    )
    parser.add_argument(
        "--batch", type=positive_int, default=2, help="sequences decoded together (default 2)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random Q, K and V (default 0)"
    )
    parser.add_argument(
        "--outlier-gain",
        type=positive_float,
        default=2.0,
        help="gain of the 8 amplified K channels (default 2)",
    )
    parser.add_argument(
        "--ramp",
        type=positive_float,
        nargs=2,
        default=(1.0, 2.0),
        metavar=("FIRST", "LAST"),
        help="K's per-token scale at the first and last token (default 1 2)",
    )
    parser.add_argument(
        "--device",
        type=device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda if torch sees a GPU, else cpu)",
    )


def run(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    run_demo(
        length=args.length,
        batch=args.batch,
        seed=args.seed,
        device=args.device,
        outlier_gain=args.outlier_gain,
        ramp=tuple(args.ramp),
    )
    return 0
