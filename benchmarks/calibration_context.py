"""INT2 keys everywhere at 4K against the positions OSCAR was calibrated for (session 19).

Reads committed H200 runs of the row "OSCAR-select per-KV-head INT2 + GPTQ keys + BF16 64/256"
(4.02 bits) calibrated on 4 x 2,048 tokens at their own positions (0-2K), with RoPE shifts over
0-4K (``--oscar-context 4096``) and over 0-8K (``--oscar-context 8192``), on two sets of 64 x 60
perplexity windows of the FOSCAR paper at a 4,096-token prefix: A, after token 8,448 (the
windows of sessions 17-18: runs with an 8K prefix too start there) and B, after token 4,352
(runs with the 4K prefix alone). Prints the gaps to BF16, the gaps pooled over both sets and
the paired differences between calibrations on the same windows (95% intervals over the 60
scored positions, as ``foscar eval``'s tables); writes a plot beside the runs. Nothing is
re-measured.

    python benchmarks/calibration_context.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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


def interval(d: list[float]) -> tuple[float, float, float]:
    """Mean NLL difference as a perplexity ratio in %, with its 95% interval."""
    m = sum(d) / len(d)
    half = 1.96 * math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1)) / math.sqrt(len(d))
    return tuple(100 * (math.exp(x) - 1) for x in (m, m - half, m + half))


def rows(path: str) -> dict[str, dict]:
    return {r["format"]: r for r in json.loads((H200 / path).read_text())["rows"]}


def main() -> None:
    nll = {}
    for windows, runs in RUNS.items():
        bf16 = set()
        for context, path in runs.items():
            r = rows(path)
            nll[windows, context] = r[ROW]["nll"]["4096"]
            nll[windows, "BF16"] = r["BF16"]["nll"]["4096"]
            bf16.add(tuple(round(x, 4) for x in r["BF16"]["nll"]["4096"]))
        assert len(bf16) == 1, f"windows {windows}: the runs' BF16 rows differ (other windows)"
    gaps = {}
    print("| calibrated for | windows A | windows B | pooled | needles 4K (BF16 36/49) |")
    print("|---|---|---|---|---|")
    for c in CONTEXTS:
        cells = []
        for w in ("A", "B", "pooled"):
            sets = ("A", "B") if w == "pooled" else (w,)
            d = [a - b for s in sets for a, b in zip(nll[s, c], nll[s, "BF16"])]
            gaps[w, c] = interval(d)
            cells.append("{:+.1f}% [{:+.1f}, {:+.1f}]".format(*gaps[w, c]))
        needle = rows(NEEDLES[c])[ROW]["needle"]["4096"]
        gaps["needle", c] = needle["found"]
        print(f"| {c} | " + " | ".join(cells) + f" | {needle['found']}/{needle['trials']} |")
    print()
    for w in ("A", "B"):
        for c in ("0-2K", "0-8K"):
            d = [a - b for a, b in zip(nll[w, "0-4K"], nll[w, c])]
            mid, lo, hi = interval(d)
            print(f"windows {w}: 0-4K against {c}: {mid:+.1f}% [{lo:+.1f}, {hi:+.1f}]")
    plot(gaps, H200 / "session19" / "calibration_context.png")


def plot(gaps: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    x = range(len(CONTEXTS))
    for k, (w, label) in enumerate(
        (("A", "windows A (after 8.4K)"), ("B", "windows B (after 4.4K)"), ("pooled", "pooled"))
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
    left.set_title("INT2 keys everywhere, 4.02 bits (dotted: the 5% target)")
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
