"""The ``foscar`` command line: ``foscar demo``, ``bench``, ``eval``, ``calibrate``."""

from __future__ import annotations

import argparse
import sys

from . import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="foscar", description="FOSCAR decode attention over 2- and 4-bit KV caches"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="every KV format on the paper's stress input (CPU, < 1 min)")
    demo.add_arguments(p)
    p.set_defaults(run=demo.run)
    p = sub.add_parser(
        "bench",
        help="decode latency beside FlashInfer on a GPU (paper grid); --e2e: end-to-end serving",
    )
    from .bench import e2e, grid

    grid.add_arguments(p)
    e2e.add_arguments(p)
    p.set_defaults(run=lambda a: e2e.run(a) if a.e2e else grid.run(a))
    p = sub.add_parser(
        "eval", help="every KV format against BF16 on a real model (SmolLM2 offline; CPU ok)"
    )
    from .eval import run as eval_run

    eval_run.add_arguments(p)
    p.set_defaults(run=eval_run.run)
    p = sub.add_parser(
        "calibrate", help="OSCAR rotations and clip ratios for a model (SmolLM2 offline; CPU ok)"
    )
    from .oscar import cli as oscar_cli

    oscar_cli.add_arguments(p)
    p.set_defaults(run=oscar_cli.run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
