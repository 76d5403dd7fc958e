"""``foscar eval`` output: a progress bar while it runs, then JSON, a markdown table and a plot."""

from __future__ import annotations

import math
import os
import sys
import textwrap
import time
from pathlib import Path

from ..results import results_json

__all__ = [
    "Progress",
    "markdown_table",
    "calibration_table",
    "write_results",
    "plot",
    "ppl_gap",
    "row_label",
]


class Progress:
    """Text-line progress bar over weighted units of work, with elapsed time and an estimate."""

    def __init__(self, total: float, out=sys.stdout, width: int = 24) -> None:
        self.total, self.done, self.out, self.width = max(total, 1e-9), 0.0, out, width
        self.start = time.perf_counter()
        #: 1-minute load averages seen at each step (other jobs stretch the wall time)
        self.loads: list[float] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def step(self, weight: float, text: str) -> None:
        if hasattr(os, "getloadavg"):
            self.loads.append(os.getloadavg()[0])
        self.done = min(self.total, self.done + weight)
        frac = self.done / self.total
        fill = round(frac * self.width)
        t = self.elapsed()
        eta = t / frac - t if frac > 0 else float("nan")
        print(
            f"[{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} {t:6.0f}s "
            f"(~{eta:5.0f}s left)  {text}",
            file=self.out,
            flush=True,
        )

    def note(self, text: str) -> None:
        print(
            f"{'':{self.width + 2}} {'':4} {self.elapsed():6.0f}s  {text}",
            file=self.out,
            flush=True,
        )


def paired_gap(d: list[float]) -> tuple[float, float, float]:
    """``(gap, low, high)`` in %: the perplexity ratio of mean NLL differences ``d`` (paired
    samples: scored positions, or windows' means) and its 95% interval,
    ``exp(mean(d) +- 1.96 * std(d) / sqrt(len(d))) - 1``."""
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1))
    half = 1.96 * sd / math.sqrt(len(d))
    return tuple(100 * (math.exp(x) - 1) for x in (mean, mean - half, mean + half))


def nll_gap(row: dict, base: dict, n: str) -> tuple[float, float, float]:
    """:func:`paired_gap` of ``row`` against ``base`` at prefix ``n``, paired over the scored
    positions (their per-position NLL differences)."""
    return paired_gap([a - b for a, b in zip(row["nll"][n], base["nll"][n], strict=True)])


def ppl_gap(row: dict, base: dict, n: str) -> tuple[float, float]:
    """Perplexity gap to ``base`` in %, and the half-width of its 95% interval in %
    (:func:`nll_gap`'s)."""
    _, low, high = nll_gap(row, base, n)
    return 100 * (row["ppl"][n] / base["ppl"][n] - 1), (high - low) / 2


def row_label(row: dict) -> str:
    """A row's name in tables and plots: its format, and ``[BACKEND]`` for a row of a
    ``--backends`` run (the JSON keeps the backend as the row's ``backend`` field)."""
    return f"{row['format']} [{row['backend']}]" if row.get("backend") else row["format"]


def _ppl_cell(row: dict, n: str, base: dict | None) -> str:
    ppl = row.get("ppl", {}).get(n)
    if ppl is None:
        return ""
    if base is None or row is base:
        return f"{ppl:.2f}"
    gap, half = ppl_gap(row, base, n)
    return f"{ppl:.2f} ({gap:+.1f}% ±{half:.1f})"


def _needle_cell(row: dict, n: str, key: str) -> str:
    needle = row.get("needle", {}).get(n, {})
    return f"{needle[key]}/{needle['trials']}" if key in needle else ""


def markdown_table(result: dict) -> str:
    """One row per format: bits, decode-path perplexity (gap to BF16 with its 95% interval),
    greedy agreement, needle retrievals."""
    rows = result["rows"]
    base = next((r for r in rows if r["format"] == "BF16"), None)
    has = {k: any(k in r for r in rows) for k in ("ppl", "agreement", "needle")}
    prefixes = [str(n) for n in result["config"].get("ppl_prefixes", [])] if has["ppl"] else []
    lengths = [str(n) for n in result["config"].get("needle_lengths", [])] if has["needle"] else []
    head = ["format", "bits/elem"]
    head += [f"PPL {_k(int(n))} (vs BF16)" for n in prefixes]
    if has["agreement"]:
        head.append("greedy agreement")
    # the generated score where a run measured it (runs before it only hold the strict one)
    generated = [
        n for n in lengths if any("found_generated" in r.get("needle", {}).get(n, {}) for r in rows)
    ]
    head += [f"needle {_k(int(n))}" for n in lengths]
    head += [f"needle {_k(int(n))} generated" for n in generated]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [row_label(r), f"{r['bits_per_element']:.2f}"]
        cells += [_ppl_cell(r, n, base) for n in prefixes]
        if has["agreement"]:
            cells.append(f"{100 * r['agreement']:.1f}%" if "agreement" in r else "")
        cells += [_needle_cell(r, n, "found") for n in lengths]
        cells += [_needle_cell(r, n, "found_generated") for n in generated]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def backends_table(result: dict) -> str:
    """For a ``--backends`` run: each format's rows through the later backends against its row
    through the first, perplexity gap and 95% interval paired over the same scored positions
    (what a backend's arithmetic costs, apart from what the format costs); "" for any other
    run."""
    named = result["config"].get("backends", {}).get("named") or []
    rows = [r for r in result["rows"] if r.get("backend") and "ppl" in r]
    firsts = {r["format"]: r for r in rows if named and r["backend"] == named[0]}
    prefixes = [str(n) for n in result["config"].get("ppl_prefixes", [])]
    lines = []
    for r in rows:
        first = firsts.get(r["format"])
        if first is None or r is first:
            continue
        cells = []
        for n in prefixes:
            if n in r["ppl"] and n in first["ppl"]:
                gap, low, high = nll_gap(r, first, n)
                cells.append(f"{gap:+.1f}% [{low:+.1f}, {high:+.1f}]")
            else:
                cells.append("")
        lines.append(f"| {r['format']} | {r['backend']} against {first['backend']} | "
                     + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = ["format", "backends"] + [f"PPL {_k(int(n))} gap" for n in prefixes]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines])


def _load_text(result: dict) -> str:
    load = result.get("load_average")
    if load:
        mean, peak = load["mean"], load["max"]
        return f" (1-minute load average during the run: mean {mean:.1f}, max {peak:.1f})"
    if result.get("load_average_at_end") is not None:
        return f" (1-minute load average at the end: {result['load_average_at_end']:.1f})"
    return ""


def calibration_table(result: dict) -> str:
    """The clipping calibration: mean relative error of the attention output over the layers
    for each candidate ratio ``p`` (``1`` = min-max), K and V quantized one at a time."""
    cal = result["config"].get("calibration", {})
    errors = cal.get("mean_relative_attention_error", {})
    if not errors:
        return ""
    ratios = list(next(iter(errors.values())))
    chosen = cal.get("clips", {})
    lines = [
        "| quantized | " + " | ".join(f"p = {p}" for p in ratios) + " | clipped rows use |",
        "|---|" + "---|" * (len(ratios) + 1),
    ]
    for name, row in errors.items():
        fmt, role = name.rsplit(" ", 1)
        p = chosen.get(fmt, {}).get(f"p_{role}")
        best = min(row, key=row.get)
        cells = [f"**{e:.3f}**" if r == best else f"{e:.3f}" for r, e in row.items()]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {p:g} |")
    return "\n".join(lines)


def _k(n: int) -> str:
    return f"{n / 1024:.0f}K" if n >= 1024 and n % 1024 == 0 else str(n)


def is_model_row(row: dict) -> bool:
    """The row of the model's own K/V in a DynamicCache (short "model"; "fp32" in older
    results, which named it after the model's dtype)."""
    return row.get("short") in ("model", "fp32")


def plot(result: dict, path: Path) -> None:
    """One panel per measured metric: perplexity gap to BF16 against prefix length, greedy
    agreement, needle retrieval (a needle-only run draws the needle panel alone)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["format"] not in ("BF16",)]
    base = next(r for r in result["rows"] if r["format"] == "BF16")
    # bar labels wrapped: a long format name must not squeeze the bars out of the figure
    names = [textwrap.fill(row_label(r), 48) for r in result["rows"]]
    prefixes = [str(n) for n in result["config"].get("ppl_prefixes", [])]
    # the needle lengths some row measured (a row without one draws no bar there)
    lengths = [
        str(n)
        for n in result["config"].get("needle_lengths", [])
        if any(str(n) in r.get("needle", {}) for r in result["rows"])
    ]
    panels = [
        name
        for name, present in (
            ("ppl", prefixes and "ppl" in base and any("ppl" in r for r in rows)),
            ("agreement", any("agreement" in r for r in rows)),
            ("needle", bool(lengths)),
        )
        if present
    ]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 2, 7.5), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    if "ppl" in axes:
        ax = axes["ppl"]
        for r in rows:
            if "ppl" not in r:
                continue
            gaps = [
                100 * (r["ppl"][n] / base["ppl"][n] - 1)
                if n in r["ppl"] and n in base["ppl"]
                else math.nan
                for n in prefixes
            ]
            style = "--" if is_model_row(r) else ("-o" if "INT4" in r["format"] else "-s")
            ax.plot([int(n) for n in prefixes], gaps, style, label=row_label(r))
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1)
        ax.axhline(1, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("prefix tokens")
        ax.set_ylabel("decode-path perplexity vs BF16 (%)")
        ax.set_title("perplexity gap (dotted: +1%)")
        # below the panel: the gaps of every sign are data
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    if "agreement" in axes:
        ax = axes["agreement"]
        agree = [100 * r.get("agreement", math.nan) for r in result["rows"]]
        ax.barh(names, agree, color="tab:blue")
        ax.invert_yaxis()
        ax.set_xlim(0, 100)
        tokens = result["config"].get("agreement_tokens", 64)
        ax.set_xlabel(f"% of the first {tokens} tokens = BF16's")
        ax.set_title("greedy agreement")
    if "needle" in axes:
        ax = axes["needle"]
        needles = [
            r["needle"][n] for r in result["rows"] for n in lengths if n in r.get("needle", {})
        ]
        # the generated score when every cell has it (runs before it hold the strict one only)
        key = "found_generated" if all("found_generated" in c for c in needles) else "found"
        h = 0.8 / len(lengths)
        for j, n in enumerate(lengths):
            rates = [
                100 * r["needle"][n][key] / r["needle"][n]["trials"]
                if n in r.get("needle", {})
                else math.nan
                for r in result["rows"]
            ]
            ax.barh(
                [i + j * h for i in range(len(names))],
                rates,
                height=h,
                label=f"{_k(int(n))} tokens",
            )
        ax.set_yticks([i + h * (len(lengths) - 1) / 2 for i in range(len(names))], names)
        ax.invert_yaxis()
        ax.set_xlim(0, 100)
        ax.set_xlabel("needles retrieved (%)")
        ax.set_title(
            "needle in a haystack: "
            + ("generated answers" if key == "found_generated" else "teacher-forced, exact")
        )
        ax.legend(fontsize=8)
    model = result["config"].get("model", "")
    fig.suptitle(f"foscar eval: {model}, KV formats against the BF16 cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(result: dict, out_dir: str | Path, name: str) -> dict[str, Path]:
    """Write ``<name>.json``, ``<name>.md`` (and ``<name>.png`` when matplotlib is there)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    paths["json"].write_text(results_json(result))
    cfg = result["config"]
    lines = [
        f"# foscar eval: {cfg.get('model')}",
        "",
        markdown_table(result),
        "",
    ]
    pairs = backends_table(result)
    if pairs:
        lines += [
            "Backends against each other, paired over the same scored positions (perplexity "
            "gap and its 95% interval): what a backend's arithmetic costs apart from its "
            "format's quantization.",
            "",
            pairs,
            "",
        ]
    lines += [
        "Sizes of this run: " + cfg.get("sizes", ""),
        "",
        "Texts: " + "; ".join(f"{k}: {v}" for k, v in cfg.get("texts", {}).items()),
        "",
        f"Machine: {cfg.get('device')}; {cfg.get('versions')}; "
        f"wall time {result.get('seconds', 0):.0f} s{_load_text(result)}.",
    ]
    if cfg.get("command"):
        lines += ["", f"Command: `{cfg['command']}`"]
    table = calibration_table(result)
    if table:
        lines += [
            "",
            "Clipping calibration (mean relative error of the attention output over the layers "
            f"on {cfg.get('calibration_tokens')} tokens of the calibration text, K or V "
            "quantized alone; bold: the smallest; p = 1 is min-max, and the clipped rows take "
            "the best p < 1 even where p = 1 wins: they measure OSCAR's clipping on an unrotated "
            "cache):",
            "",
            table,
        ]
    if cfg.get("oscar"):
        from .oscar_rows import report as oscar_report

        lines += ["", oscar_report(cfg["oscar"])]
    paths["md"].write_text("\n".join(lines) + "\n")
    try:
        plot(result, out / f"{name}.png")
        paths["png"] = out / f"{name}.png"
    except ImportError:
        pass
    return paths
