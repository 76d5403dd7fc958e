"""INT2 keys everywhere at 4K against the positions OSCAR was calibrated for (session 19).

Reads committed H200 runs of the row "OSCAR-select per-KV-head INT2 + GPTQ keys + BF16 64/256"
(4.02 bits) calibrated on 4 x 2,048 tokens at their own positions (0-2K), with RoPE shifts over
0-4K (``--oscar-context 4096``) and over 0-8K (``--oscar-context 8192``), on two sets of 64 x 60
perplexity windows of the FOSCAR paper at a 4,096-token prefix: A, from token 8,388 (the
windows of sessions 17-18: runs with an 8K prefix too start there, 256 + the 8K prefix cut to
8,132 tokens) and B, from token 4,352 (runs with the 4K prefix alone). Prints the gaps to
BF16, the gaps pooled over both sets and the paired differences between calibrations on the
same windows, each with two 95% intervals: over the 60 scored positions' means (as
``foscar eval``'s tables) and, wider, over the 64 windows' means (the windows are the
independent samples: every position's mean averages the same windows). Writes a plot beside
the runs (intervals over windows). Nothing is re-measured.

    python benchmarks/calibration_context.py
"""

from __future__ import annotations

import json
from pathlib import Path

from foscar.eval.report import paired_gap

H200 = Path(__file__).resolve().parent / "results" / "h200"
ROW = "OSCAR-select per-KV-head INT2 + GPTQ keys + BF16 64/256 (fitted clips)"
CONTEXTS = ("0-2K", "0-4K", "0-8K")
RUNS = {
    "A": {
        "0-2K": "session17/oscar_smollm2_h200.json",
        "0-4K": "session19/oscar_smollm2_h200_s19-windows.json",
        "0-8K": "session18/oscar_smollm2_h200_s18-ppl.json",
    },
    "B": {
        "0-2K": "session19/oscar_smollm2_h200_s19-context-none.json",
        "0-4K": "session19/oscar_smollm2_h200_s19-short.json",
        "0-8K": "session19/oscar_smollm2_h200_s19-context-8192.json",
    },
}
# 4K needles on one set of 49 trials (passcodes depend on seed and length alone)
NEEDLES = {
    "0-2K": "session18/oscar_smollm2_h200_s18-paired-base.json",
    "0-4K": "session19/oscar_smollm2_h200_s19-short.json",
    "0-8K": "session18/oscar_smollm2_h200_s18-paired-shift.json",
}


def cell(by_position: list[float], by_window: list[float]) -> str:
    """The gap with its intervals over positions and [[over windows]]."""
    mid, lo, hi = paired_gap(by_position)
    _, wlo, whi = paired_gap(by_window)
    return f"{mid:+.1f}% [{lo:+.1f}, {hi:+.1f}] [[{wlo:+.1f}, {whi:+.1f}]]"


def differences(a: dict, b: dict) -> tuple[list[float], list[float]]:
    """Paired NLL differences of two rows at 4K: per scored position, per window."""
    positions = [x - y for x, y in zip(a["nll"]["4096"], b["nll"]["4096"], strict=True)]
    windows = [
        sum(x) / len(x) - sum(y) / len(y)
        for x, y in zip(a["nll_windows"]["4096"], b["nll_windows"]["4096"], strict=True)
    ]
    return positions, windows


def rows(path: str) -> dict[str, dict]:
    return {r["format"]: r for r in json.loads((H200 / path).read_text())["rows"]}


def main() -> None:
    row = {}  # (windows, calibration or "BF16") -> the result row
    for windows, runs in RUNS.items():
        bf16 = set()
        for context, path in runs.items():
            r = rows(path)
            row[windows, context], row[windows, "BF16"] = r[ROW], r["BF16"]
            bf16.add(tuple(round(x, 4) for x in r["BF16"]["nll"]["4096"]))
        assert len(bf16) == 1, f"windows {windows}: the runs' BF16 rows differ (other windows)"
    gaps = {}
    print("PPL gap at 4K, 95% intervals over positions [..] and over windows [[..]]\n")
    print("| calibrated for | windows A | windows B | pooled | needles 4K (BF16 36/49) |")
    print("|---|---|---|---|---|")
    for c in CONTEXTS:
        cells = []
        for w in ("A", "B", "pooled"):
            parts = [
                differences(row[s, c], row[s, "BF16"])
                for s in (("A", "B") if w == "pooled" else (w,))
            ]
            by_position = [x for p, _ in parts for x in p]
            by_window = [x for _, d in parts for x in d]
            gaps[w, c] = paired_gap(by_window)
            cells.append(cell(by_position, by_window))
        needle = rows(NEEDLES[c])[ROW]["needle"]["4096"]
        gaps["needle", c] = needle["found"]
        print(f"| {c} | " + " | ".join(cells) + f" | {needle['found']}/{needle['trials']} |")
    print()
    for w in ("A", "B"):
        for c in ("0-2K", "0-8K"):
            print(
                f"windows {w}: 0-4K against {c}: " + cell(*differences(row[w, "0-4K"], row[w, c]))
            )
    plot(gaps, H200 / "session19" / "calibration_context.png")


def plot(gaps: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    x = range(len(CONTEXTS))
    for k, (w, label) in enumerate(
        (("A", "windows A (from 8.4K)"), ("B", "windows B (from 4.4K)"), ("pooled", "pooled"))
    ):
        mid = [gaps[w, c][0] for c in CONTEXTS]
        err = [[m - gaps[w, c][1] for m, c in zip(mid, CONTEXTS)],
               [gaps[w, c][2] - m for m, c in zip(mid, CONTEXTS)]]  # fmt: skip
        left.errorbar([i + 0.1 * (k - 1) for i in x], mid, yerr=err, fmt="-o", capsize=3,
                      label=label)  # fmt: skip
    left.axhline(5, color="gray", ls=":", lw=1)
    left.set_xticks(list(x), CONTEXTS)
    left.set_xlabel("positions the keys were calibrated for (RoPE shifts)")
    left.set_ylabel("decode-path perplexity vs BF16 at 4K (%)")
    left.set_title("INT2 keys everywhere, 4.02 bits (95% over windows; dotted: 5%)")
    left.legend(fontsize=8)
    right.bar(list(x), [gaps["needle", c] for c in CONTEXTS], color="tab:orange")
    right.axhline(36, color="gray", ls=":", lw=1)
    right.set_xticks(list(x), CONTEXTS)
    right.set_ylim(0, 49)
    right.set_xlabel("positions the keys were calibrated for")
    right.set_ylabel("needles retrieved of 49 at 4K (strict)")
    right.set_title("4K needles, the same 49 trials (dotted: BF16)")
    fig.suptitle("SmolLM2-135M on the H200 through the kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
