"""The ``foscar`` command line: one subcommand per module of :mod:`foscar.commands`.

Each subcommand module has ``HELP`` (its line in ``foscar --help``), ``add_arguments(parser)``
and ``run(args) -> int``; :data:`COMMANDS` lists them. Bad values are refused when the command
line is parsed (argument types of :mod:`foscar.commands.options`), or by ``run`` raising
``ValueError`` (a combination of options, or what only the model or the text can tell): both
end as one error line and exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, calibrate, demo, serve
from . import eval as eval_command

#: subcommand name -> its module
COMMANDS = {"demo": demo, "bench": bench, "eval": eval_command, "calibrate": calibrate,
            "serve": serve}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foscar", description="FOSCAR decode attention over 2- and 4-bit KV caches"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(run=module.run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:
        message = " ".join(str(e).split())
        args.parser.exit(2, f"{args.parser.prog}: error: {message}\n")


if __name__ == "__main__":
    sys.exit(main())
