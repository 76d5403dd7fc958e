"""Bits per element against the 4K perplexity gap of foscar eval's committed OSCAR rows.

Reads the result JSONs under ``benchmarks/results/cpu/`` (nothing is re-measured): for each
row below, its stored bits per K/V element and its decode-path NLLs at the 4K prefix, paired
with the BF16 row of the same run; the gap is ``exp(mean(nll - nll_bf16)) - 1`` and the bar
the 95% interval of that mean over the scored positions (as ``foscar eval``'s tables).

    python benchmarks/plot_oscar_bits.py   # -> results/cpu/oscar_bits_vs_ppl_4k.{png,md}
"""

from __future__ import annotations

import json
from pathlib import Path

from foscar.eval.report import nll_gap

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"

#: (result file, a substring of the row's name, label, family)
ROWS = [
    ("oscar_smollm2_gptq_4k", "OSCAR-select per-KV-head INT2 + GPTQ keys + BF16", "K2 V2", "INT2"),
    ("oscar_smollm2_gptq_64_512_4k", "+ BF16 64/512", "K2 V2, 64/512 windows", "windows"),
    ("oscar_smollm2_gptq_64_1024_4k", "+ BF16 64/1024", "K2 V2, 64/1024 windows", "windows"),
    ("oscar_smollm2_int4_key_layers6_4k", "INT4 keys in 6 layers", "K4 in 6 layers", "layers"),
    ("oscar_smollm2_int4_key_layers10_4k", "INT4 keys in 10 layers", "K4 in 10 layers", "layers"),
    ("oscar_smollm2_int4_key10_value6_4k", "INT4 values in 6", "K4 in 10, V4 in 6", "layers"),
    ("oscar_smollm2_mixed_widths_4k", "K INT4, V INT2", "K4 V2", "roles"),
    ("oscar_smollm2_mixed_widths_4k", "K INT2 + GPTQ keys, V INT4", "K2 V4", "roles"),
]
COLORS = {"INT2": "black", "windows": "tab:blue", "layers": "tab:red", "roles": "tab:green"}
#: label offsets (points) where the default, up and right, would overlap another label
OFFSETS = {"K4 in 10, V4 in 6": (-20, -16)}


def points() -> list[dict]:
    out = []
    for name, match, label, family in ROWS:
        rows = json.loads((RESULTS / f"{name}.json").read_text())["rows"]
        bf16 = next(r for r in rows if r["format"] == "BF16")
        (row,) = [r for r in rows if match in r["format"] and "(fitted clips)" in r["format"]]
        g, lo, hi = nll_gap(row, bf16, "4096")
        out.append(
            dict(label=label, family=family, bits=row["bits_per_element"], gap=g, lo=lo, hi=hi)
        )
    return out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for p in pts:
        c = COLORS[p["family"]]
        ax.errorbar(
            p["bits"], p["gap"], yerr=[[p["gap"] - p["lo"]], [p["hi"] - p["gap"]]], fmt="o",
            color=c, capsize=3,
        )  # fmt: skip
        xy = OFFSETS.get(p["label"], (6, 4))
        ax.annotate(p["label"], (p["bits"], p["gap"]), textcoords="offset points", xytext=xy)
    ax.axhline(5, color="gray", ls=":", lw=1)
    ax.text(ax.get_xlim()[0], 5.2, " issue 6's target: 5%", color="gray", fontsize=8)
    ax.set_xlabel(
        "stored bits per K/V element at 4K (fp32 scale and offset, BF16 windows included)"
    )
    ax.set_ylabel("decode-path perplexity gap to BF16 at 4K (%)")
    ax.set_title(
        "SmolLM2-135M, OSCAR-select per-KV-head, GPTQ keys: where the bits go\n"
        "(BF16 64/256 windows unless named; black: INT2; blue: wider windows;\n"
        "red: INT4 keys (and values) in some layers; green: one role at INT4)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "oscar_bits_vs_ppl_4k.png", dpi=130)
    lines = [
        "| row | bits/elem | PPL gap at 4K (95% interval) | result file |",
        "|---|---|---|---|",
    ]
    for (name, *_), p in zip(ROWS, pts):
        lines.append(
            f"| {p['label']} | {p['bits']:.2f} | {p['gap']:+.1f}% [{p['lo']:+.1f}, {p['hi']:+.1f}]"
            f" | `{name}` |"
        )
    (RESULTS / "oscar_bits_vs_ppl_4k.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
