"""Needle hits of foscar eval's committed runs, summed per row over several runs.

Each run draws its passcodes and places them at its depths, so runs with other
``--needle-depths`` add other trials; a trial (length, depth, passcode) that several runs
measured for a row counts once (the BF16 row of runs with the same depths, and its first run's
result). Rows are matched by their exact name; a row counts only the lengths its runs
measured. Reads the JSONs under ``benchmarks/results/cpu/`` (``../h200/NAME`` for a
device run); nothing is re-measured.

Two counts per cell: ``hits`` (foscar eval's score: the argmax at every answer position is
the answer's token, so greedy decoding would emit `` 60494``) and ``digits`` (the argmax
tokens after the first answer position spell the passcode's digits: what a trial whose first
token is `` "`` instead of `` `` still retrieved; teacher-forced, so the digits are predicted
after the right first token, not after the one the model chose); and ``generated`` (runs
from session 17 on: the first number of the greedily decoded answer is the passcode; ``-``
where some trial of the cell was measured before that).

    python benchmarks/needle_totals.py RUN [RUN ...]   # result names without .json
    python benchmarks/needle_totals.py --paired RUN [RUN ...]

``--paired``: each row against the BF16 row of the same runs, trial by trial (strict hits):
trials both retrieve, only the row, only BF16, and the exact two-sided McNemar p-value of
the discordant ones (a sign test: under "the row retrieves as BF16 does" each discordant
trial goes either way with probability 1/2).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"


def totals(runs: list[str]) -> dict[str, dict[str, list]]:
    """``{row name: {length: [hits, digits, generated, trials]}}`` over the distinct trials of
    ``runs``; ``generated`` is None where a trial's run did not score the generated answer."""
    seen: dict[str, dict[str, dict[tuple, tuple]]] = {}
    for run in runs:
        for row in json.loads((RESULTS / f"{run}.json").read_text())["rows"]:
            for length, n in row.get("needle", {}).items():
                trials = seen.setdefault(row["format"], {}).setdefault(length, {})
                generated = n.get("hits_generated", [None] * len(n["hits"]))
                cells = zip(
                    n["depths"], n["values"], n["hits"], n["argmax"], generated, strict=True
                )
                for depth, value, hit, argmax, said in cells:
                    digits = argmax.endswith(str(value))
                    trials.setdefault((float(depth), str(value)), (bool(hit), digits, said))
    out = {}
    for name, row in seen.items():
        out[name] = {}
        for n, t in row.items():
            said = [g for _, _, g in t.values()]
            generated = None if None in said else sum(said)
            out[name][n] = [sum(h for h, _, _ in t.values()), sum(d for _, d, _ in t.values()),
                            generated, len(t)]  # fmt: skip
    return out


def table(runs: list[str]) -> str:
    t = totals(runs)
    lengths = sorted({k for row in t.values() for k in row}, key=int)
    lines = [
        "| row | "
        + " | ".join(f"needle {int(n) // 1024}K: hits (digits; generated)" for n in lengths)
        + " |",
        "|---|" + "---|" * len(lengths),
    ]

    def cell(c):
        hits, digits, generated, trials = c
        return f"{hits}/{trials} ({digits}; {'-' if generated is None else generated})"

    for name, row in t.items():
        cells = [cell(row[n]) if n in row else "" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def strict_hits(runs: list[str]) -> dict[str, dict[str, dict[tuple, bool]]]:
    """``{row name: {length: {(depth, passcode): hit}}}`` over ``runs`` (first run wins)."""
    seen: dict[str, dict[str, dict[tuple, bool]]] = {}
    for run in runs:
        for row in json.loads((RESULTS / f"{run}.json").read_text())["rows"]:
            for length, n in row.get("needle", {}).items():
                trials = seen.setdefault(row["format"], {}).setdefault(length, {})
                for depth, value, hit in zip(n["depths"], n["values"], n["hits"], strict=True):
                    trials.setdefault((float(depth), str(value)), bool(hit))
    return seen


def mcnemar_p(only_row: int, only_ref: int) -> float:
    """Exact two-sided McNemar p-value of ``only_row`` against ``only_ref`` discordant trials."""
    n, k = only_row + only_ref, min(only_row, only_ref)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_table(runs: list[str], reference: str = "BF16") -> str:
    """Each row's strict hits against ``reference``'s on the trials both measured."""
    seen = strict_hits(runs)
    if reference not in seen:
        raise SystemExit(f"no row named {reference!r} in {runs}")
    ref = seen[reference]
    lengths = sorted({k for row in seen.values() for k in row}, key=int)
    lines = [
        "| row | "
        + " | ".join(
            f"needle {int(n) // 1024}K: row / {reference} (only row, only {reference}; McNemar p)"
            for n in lengths
        )  # fmt: skip
        + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for name, row in seen.items():
        if name == reference:
            continue
        cells = []
        for n in lengths:
            common = sorted(set(row.get(n, {})) & set(ref.get(n, {})))
            if not common:
                cells.append("")
                continue
            mine = [row[n][t] for t in common]
            theirs = [ref[n][t] for t in common]
            only_row = sum(a and not b for a, b in zip(mine, theirs))
            only_ref = sum(b and not a for a, b in zip(mine, theirs))
            cells.append(
                f"{sum(mine)} / {sum(theirs)} of {len(common)} ({only_row}, {only_ref}; "
                f"p = {mcnemar_p(only_row, only_ref):.2f})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    paired = args[:1] == ["--paired"]
    if paired:
        args = args[1:]
    if not args:
        sys.exit(__doc__)
    print(paired_table(args) if paired else table(args))
