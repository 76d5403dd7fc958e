"""Bits against accuracy on the H200: INT2 everywhere, and INT4 in more and more layers.

Reads committed ``foscar eval`` runs under ``benchmarks/results/h200/`` (nothing is
re-measured; all calibrated over positions 0-8K, the mixed recipe's default): for each row, its
stored bits per K/V element at 4K, its decode-path perplexity gap to the BF16 row of the same
run at 4K and 8K (windows A: 64 x 60 tokens after each prefix; paired per scored position, as
``foscar eval``'s tables), and its strict needle hits minus BF16's on the same 49 trials per
length (``--seed 0``'s passcodes).

    python benchmarks/oscar_frontier.py   # -> results/h200/session20/oscar_frontier.{png,md}
"""

from __future__ import annotations

import json
from pathlib import Path

from needle_totals import strict_hits  # (benchmarks/, this script's folder)

from foscar.eval.report import nll_gap

RESULTS = Path(__file__).resolve().parent / "results" / "h200"
OUT = RESULTS / "session20"
SELECT = "OSCAR-select per-KV-head INT2 + GPTQ keys"
WINDOWS = " + BF16 64/256 (fitted clips)"

#: (label, row name, run with its perplexity and 2K needles, run with its 4K / 8K needles)
ROWS = [
    ("INT2 everywhere", SELECT + WINDOWS, "session18/oscar_smollm2_h200_s18-ppl",
     "session18/oscar_smollm2_h200_s18-paired-shift"),
    ("K4 in 10 layers", SELECT + ", INT4 keys in 10 layers" + WINDOWS,
     "session18/oscar_smollm2_h200_s18-ppl", "session18/oscar_smollm2_h200_s18-paired-shift"),
    ("K4 10, V4 6", SELECT + ", INT4 keys in 10 layers, INT4 values in 6 layers" + WINDOWS,
     "session20/oscar_smollm2_h200_s20-frontier", None),
    ("K4 15, V4 10", SELECT + ", INT4 keys in 15 layers, INT4 values in 10 layers" + WINDOWS,
     "session20/oscar_smollm2_h200_s20-frontier", None),
    ("K4 20, V4 15", SELECT + ", INT4 keys in 20 layers, INT4 values in 15 layers" + WINDOWS,
     "session20/oscar_smollm2_h200_s20-frontier", None),
    ("OSCAR INT4", "OSCAR INT4" + WINDOWS, "session20/oscar_smollm2_h200_s20-frontier", None),
]  # fmt: skip
LENGTHS = ("2048", "4096", "8192")


def _rows(run: str) -> dict[str, dict]:
    return {r["format"]: r for r in json.loads((RESULTS / f"{run}.json").read_text())["rows"]}


def _needle_gap(run: str, name: str, length: str) -> tuple[int, int, int]:
    """(row hits, BF16 hits, trials) on the trials both measured at ``length`` in ``run``."""
    hits = strict_hits([f"../h200/{run}"])
    mine, theirs = hits[name][length], hits["BF16"][length]
    common = set(mine) & set(theirs)
    return sum(mine[t] for t in common), sum(theirs[t] for t in common), len(common)


def points() -> list[dict]:
    out = []
    for label, name, ppl_run, needle_run in ROWS:
        rows = _rows(ppl_run)
        row, bf16 = rows[name], rows["BF16"]
        p = dict(label=label, bits=row["bits_per_element"], ppl={}, needle={})
        for prefix in sorted(row["nll"], key=int):
            p["ppl"][prefix] = nll_gap(row, bf16, prefix)
        for length in LENGTHS:
            in_needle_run = needle_run and length in _rows(needle_run)[name].get("needle", {})
            p["needle"][length] = _needle_gap(
                needle_run if in_needle_run else ppl_run, name, length
            )
        out.append(p)
    return out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    for prefix, color, dx in (("4096", "tab:blue", -0.012), ("8192", "tab:red", 0.012)):
        xs = [p["bits"] + dx for p in pts]
        g = [p["ppl"][prefix][0] for p in pts]
        err = [[p["ppl"][prefix][0] - p["ppl"][prefix][1] for p in pts],
               [p["ppl"][prefix][2] - p["ppl"][prefix][0] for p in pts]]  # fmt: skip
        ax1.errorbar(xs, g, yerr=err, fmt="o-", color=color, capsize=3, label=f"prefix {prefix}")
    for p in pts:
        ax1.annotate(p["label"], (p["bits"], p["ppl"]["4096"][0]), textcoords="offset points",
                     xytext=(5, 6), fontsize=8)  # fmt: skip
    ax1.axhline(5, color="gray", ls=":", lw=1)
    ax1.axhline(0, color="black", lw=0.5)
    ax1.set_xlabel("stored bits per K/V element at 4K (BF16 64/256 windows included)")
    ax1.set_ylabel("decode-path perplexity gap to BF16 (%)")
    ax1.set_title("perplexity (64 x 60 held-out tokens per prefix)", fontsize=9)
    ax1.legend(fontsize=8)
    for length, color, dx in (("2048", "tab:green", -0.015), ("4096", "tab:blue", 0.0),
                              ("8192", "tab:red", 0.015)):  # fmt: skip
        ax2.plot([p["bits"] + dx for p in pts],
                 [p["needle"][length][0] - p["needle"][length][1] for p in pts], "o-",
                 color=color, label=f"{int(length) // 1024}K")  # fmt: skip
    ax2.axhline(0, color="black", lw=0.8)
    ax2.text(ax2.get_xlim()[0], 0.4, " equal to BF16", fontsize=8)
    ax2.set_xlabel("stored bits per K/V element at 4K")
    ax2.set_ylabel("needles retrieved minus BF16's (same 49 trials)")
    ax2.set_title("needle retrieval (BF16: 49, 36, 23 of 49 at 2K, 4K, 8K)", fontsize=9)
    ax2.legend(fontsize=8, title="length")
    fig.suptitle(
        "SmolLM2-135M on the H200 through foscar's kernels: OSCAR-select per-KV-head with GPTQ "
        "keys,\nINT4 in the layers where it lowers the fitted error most (keys:values), "
        "calibrated over 0-8K",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(OUT / "oscar_frontier.png", dpi=130)
    lines = [
        "| row | bits/elem | PPL gap 4K | PPL gap 8K | needles 2K / 4K / 8K (BF16) |",
        "|---|---|---|---|---|",
    ]
    for p in pts:
        ppl = [f"{g:+.1f}% [{lo:+.1f}, {hi:+.1f}]" for g, lo, hi in p["ppl"].values()]
        needles = " / ".join(f"{a} ({b})" for a, b, _ in p["needle"].values())
        lines.append(f"| {p['label']} | {p['bits']:.2f} | {' | '.join(ppl)} | {needles} |")
    (OUT / "oscar_frontier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
