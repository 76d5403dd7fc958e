"""``foscar bench``: decode latency beside FlashInfer on one GPU, in one process.

The paper's grid (FOSCAR Sec. 6, design.md): H_Q=32, H_KV=8, D=128, page 64, g=128;
``B in {1, 8} x L in {8K, 32K, 128K, 512K}`` and ``B=64 x L in {8K, ..., 128K}`` (13 points),
token-wise K and V; ``--axes all`` adds the four K/V axis combinations at B in {1, 8},
L in {32K, 128K}. Every method runs one decode step per timed call (all kernels, split and
merge included), after warm-up, with L2 flushed before each call (untimed); the median counts.
Caches hold random values (decode cost does not depend on them): foscar's pools are filled with
random words and scales instead of quantizing 100 GB of K/V.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time

import torch

from .. import __version__
from ..cache import QuantizedKVCache
from ..decode import DecodePlan
from ..formats import KVFormat, QuantFormat
from ..results import results_json
from . import baselines
from .timing import L2Flusher, bench_stats

#: datasheet HBM bandwidth in TB/s by how the GPU's name (torch's) begins: the grids' "% of
#: peak" column
PEAK_TBPS = {"NVIDIA H200": 4.8, "NVIDIA H100 80GB HBM3": 3.35, "NVIDIA H100 NVL": 3.9,
             "NVIDIA H100 PCIe": 2.0}


def peak_tbps(gpu: str | None) -> float | None:
    """The datasheet HBM bandwidth of the GPU named ``gpu`` (TB/s), None if not in PEAK_TBPS."""
    return next((tbps for name, tbps in PEAK_TBPS.items() if gpu and gpu.startswith(name)), None)

#: GPU spin ahead of each timed call (foscar.bench.timing), so that the host's enqueue of the
#: call's kernels is not timed (a channel-wise format's call is three kernels; docs/tuning.md,
#: Conditions, says why this long)
SPIN_US = 1000
MAIN_GRID = (
    [(1, L) for L in (8192, 32768, 131072, 524288)]
    + [(8, L) for L in (8192, 32768, 131072, 524288)]
    + [(64, L) for L in (8192, 16384, 32768, 65536, 131072)]
)
AXES_GRID = [(b, L) for b in (1, 8) for L in (32768, 131072)]
AXES = [("token", "token"), ("channel", "token"), ("token", "channel"), ("channel", "channel")]


@dataclasses.dataclass(frozen=True)
class Shape:
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    group_size: int = 128


def foscar_kv_bytes(fmt: KVFormat, batch: int, kv_len: int, shape: Shape) -> int:
    """Bytes of one read of the stored codes, scales and offsets (fp32 s', z')."""
    per_token = sum(
        shape.head_dim * f.bits / 8 + 8 * shape.head_dim / f.group_size
        for f in (fmt.key, fmt.value)
    )
    return int(batch * kv_len * shape.num_kv_heads * per_token)


def random_cache(fmt: KVFormat, batch: int, kv_len: int, shape: Shape, device, seed=0):
    """A cache of ``batch`` sequences of ``kv_len`` tokens, pages shuffled, random contents."""
    pages = batch * math.ceil(kv_len / shape.page_size)
    cache = QuantizedKVCache(
        fmt,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_pages=pages,
        max_seqs=batch,
        page_size=shape.page_size,
        device=device,
        check_finite=False,
    )
    g = torch.Generator(device=device).manual_seed(seed)
    cache.set_free_order(torch.randperm(pages, device=device, generator=g).tolist())
    ids = [cache.add_sequence() for _ in range(batch)]
    for sid in ids:
        cache.assume_appended(sid, kv_len)
    for st in cache.layers:
        for t in (st.k_words, st.v_words):
            t.random_(-(2**31), 2**31 - 1, generator=g)
        for t in (st.k_scales, st.v_scales):
            s, z = t[..., 0], t[..., 1]
            s.uniform_(0.01, 0.1, generator=g)
            z.normal_(generator=g)
            z.sub_(128 * s)  # folded offsets, as the cache writes them
        for t in (st.k_sink, st.v_sink, st.k_tail, st.v_tail):
            t.normal_(generator=g)
    return cache, cache.plan(ids)


#: foscar's methods in the results and the decode_attention backend each one times
FOSCAR_BACKENDS = {
    "foscar-gluon": "gluon",
    "foscar-triton": "triton",
    "foscar-reconstruct": "triton-reconstruct",
    "foscar-gluon-reconstruct": "gluon-reconstruct",
    "foscar-gluon-e4m3": "gluon-e4m3",
}
FOSCAR_METHODS_BY_BACKEND = {b: m for m, b in FOSCAR_BACKENDS.items()}


def make_foscar(
    bits: int,
    k_axis: str,
    v_axis: str,
    batch: int,
    kv_len: int,
    shape: Shape,
    backend: str = "triton",
    device="cuda",
):
    fmt = KVFormat(
        QuantFormat(bits, k_axis, shape.group_size), QuantFormat(bits, v_axis, shape.group_size)
    )
    cache, plan = random_cache(fmt, batch, kv_len, shape, device)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    decode = DecodePlan(cache, plan, num_q_heads=shape.num_q_heads, backend=backend)

    def step():
        return decode.run(q, out=out)

    step()
    torch.cuda.synchronize()
    method = FOSCAR_METHODS_BY_BACKEND[backend]
    info = {
        "method": method,
        "kv_bytes": foscar_kv_bytes(fmt, batch, kv_len, shape),
        "format": fmt.short(),
    }

    def close():
        nonlocal cache, plan, decode, q, out
        cache = plan = decode = q = out = None

    step.close = close
    return step, info


def environment(device) -> dict:
    props = torch.cuda.get_device_properties(device)
    env = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "foscar": __version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(sys.argv),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except Exception:
        env["flashinfer"] = None
    return env


class Progress:
    """One line per finished item with elapsed time and an ETA (a text progress bar)."""

    def __init__(self, total: int, out=sys.stdout) -> None:
        self.total, self.done, self.t0, self.out = total, 0, time.perf_counter(), out

    def step(self, text: str) -> None:
        self.done += 1
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        width = 24
        bar = "#" * int(width * self.done / self.total)
        print(
            f"[{bar:<{width}}] {self.done:3d}/{self.total} {el:6.0f}s eta {eta:4.0f}s  {text}",
            file=self.out,
            flush=True,
        )


def run_grid(
    points,
    methods,
    *,
    axes=(("token", "token"),),
    bits_list=(2, 4),
    shape=Shape(),
    iters=30,
    warmup=5,
    device="cuda",
    out=sys.stdout,
    baseline_opts=None,
):
    """Time every method at every point; returns result rows (one per method and point)."""
    baseline_opts = baseline_opts or {}
    items = []
    for batch, kv_len in points:
        for m in methods:
            if m in FOSCAR_BACKENDS:
                for bits in bits_list:
                    for k_axis, v_axis in axes:
                        items.append((m, bits, k_axis, v_axis, batch, kv_len))
            else:
                items.append((m, 16 if m.endswith("bf16") else 8, "-", "-", batch, kv_len))
    progress = Progress(len(items), out)
    flusher = L2Flusher(device=device)
    rows, skipped = [], {}
    for m, bits, k_axis, v_axis, batch, kv_len in items:
        if m in skipped:
            progress.step(f"{m}: skipped ({skipped[m]})")
            continue
        try:
            if m.startswith("foscar"):
                backend = FOSCAR_BACKENDS[m]
                step, info = make_foscar(
                    bits, k_axis, v_axis, batch, kv_len, shape, backend, device
                )
            else:
                step, info = baselines.BASELINES[m](
                    batch,
                    kv_len,
                    shape.num_q_heads,
                    shape.num_kv_heads,
                    shape.head_dim,
                    shape.page_size,
                    device,
                    **baseline_opts.get(m, {}),
                )
        except ImportError as exc:
            skipped[m] = str(exc).splitlines()[0][:120]
            progress.step(f"{m}: skipped ({skipped[m]})")
            continue
        except ValueError as exc:  # a foscar backend that does not cover this format
            progress.step(f"{m} {bits}b K{k_axis[0]}V{v_axis[0]}: not covered ({str(exc)[:160]})")
            continue
        except RuntimeError as exc:
            progress.step(f"{m} B={batch} L={kv_len}: unavailable ({str(exc)[:160]})")
            baselines.free_cuda_memory()
            continue
        stats = bench_stats(step, iters=iters, warmup=warmup, flusher=flusher, spin_us=SPIN_US)
        step.close()
        del step
        baselines.free_cuda_memory()
        ms = stats["median_ms"]
        row = {
            "method": m,
            "bits": bits,
            "k_axis": k_axis,
            "v_axis": v_axis,
            "batch": batch,
            "kv_len": kv_len,
            "ms": ms,
            "p10_ms": stats["p10_ms"],
            "p90_ms": stats["p90_ms"],
            "kv_bytes": info["kv_bytes"],
            "tbps": info["kv_bytes"] / ms / 1e9,
        }
        for key in ("impl", "format"):
            if key in info:
                row[key] = info[key]
        rows.append(row)
        progress.step(
            f"{m} {bits}b K{k_axis[0]}V{v_axis[0]} B={batch} L={kv_len // 1024}K "
            f"{ms * 1e3:8.1f} us  {row['tbps']:.2f} TB/s"
        )
    flusher.free()
    return rows


# ---------------------------------------------------------------------------- reporting
def _key(r):
    return (r["batch"], r["kv_len"])


def speedups(rows, baseline="flashinfer-bf16", peak: float | None = None):
    """Each row's speedup over ``baseline`` at its point and its effective KV throughput as %
    of ``peak`` TB/s (None: not computed)."""
    base = {_key(r): r["ms"] for r in rows if r["method"] == baseline}
    for r in rows:
        b = base.get(_key(r))
        r["speedup_vs_flashinfer_bf16"] = b / r["ms"] if b else None
        r["pct_peak"] = 100 * r["tbps"] / peak if peak else None
    return rows


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _label(r):
    if r["method"].startswith("foscar"):
        axes = (
            ""
            if (r["k_axis"], r["v_axis"]) == ("token", "token")
            else f" K{r['k_axis'][0]}V{r['v_axis'][0]}"
        )
        return f"{r['method']} INT{r['bits']}{axes}"
    return r["method"]


def markdown_table(rows, peak: float | None = None) -> str:
    """The rows as one table (method x point); ``peak``: the TB/s the % column divides by."""
    labels = sorted({_label(r) for r in rows})
    points = sorted({_key(r) for r in rows})
    by = {(_label(r), _key(r)): r for r in rows}
    lines = [
        "| method | "
        + " | ".join(f"B={b} L={L // 1024}K" for b, L in points)
        + " | geomean speedup |",
        "|---" * (len(points) + 2) + "|",
    ]
    for lab in labels:
        cells, sp = [], []
        for p in points:
            r = by.get((lab, p))
            if r is None:
                cells.append("")
                continue
            s = r.get("speedup_vs_flashinfer_bf16")
            sp.append(s)
            notes = ([f"{s:.2f}x"] if s else []) + (
                [f"{r['pct_peak']:.0f}%"] if r.get("pct_peak") is not None else [])
            cells.append(f"{r['ms'] * 1e3:.1f} us" + (f" ({', '.join(notes)})" if notes else ""))
        lines.append(f"| {lab} | " + " | ".join(cells) + f" | {geomean(sp):.2f}x |")
    lines.append("")
    lines.append(
        "Cells: median latency (speedup over FlashInfer BF16 at the same point"
        + (f", effective KV throughput as % of the GPU's {peak} TB/s)." if peak else ").")
    )
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    """Speedup over FlashInfer BF16 against context length, one panel per batch (Fig. 8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    width = 5 * len(batches) + 2.5  # 2.5 inches on the right for the legend
    fig, axes = plt.subplots(1, len(batches), figsize=(width, 4), squeeze=False)
    labels = sorted({_label(r) for r in rows})
    # a colour per method and format (20 distinct), a line style per family: foscar's folded
    # kernels solid, its reconstruct ablations dashed, the baselines dotted
    palette = plt.get_cmap("tab20").colors
    color = {lab: palette[i % len(palette)] for i, lab in enumerate(labels)}

    def style(lab):
        if lab.startswith("foscar") and "reconstruct" not in lab:
            return "-"
        return "--" if lab.startswith("foscar") else ":"

    for ax, b in zip(axes[0], batches):
        for lab in labels:
            pts = sorted(
                (r["kv_len"], r["speedup_vs_flashinfer_bf16"])
                for r in rows
                if r["batch"] == b and _label(r) == lab and r.get("speedup_vs_flashinfer_bf16")
            )
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    markersize=4,
                    color=color[lab],
                    linestyle=style(lab),
                    label=lab,
                )
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("speedup over FlashInfer BF16")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0, 1 - 2.5 / width, 1))  # the legend right of the panels
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows, env, out_dir: str, name: str) -> None:
    """``name.json`` (environment, the GPU's peak TB/s, rows), ``name.md`` and ``name.png``."""
    os.makedirs(out_dir, exist_ok=True)
    peak = peak_tbps(env.get("gpu"))
    speedups(rows, peak=peak)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        f.write(results_json({"environment": env, "peak_tbps": peak, "rows": rows}))
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(f"# {name}\n\n{json.dumps(env)}\n\n{markdown_table(rows, peak)}\n")
    try:
        plot(rows, os.path.join(out_dir, f"{name}.png"))
    except ImportError:
        print("matplotlib not importable: no plot", file=sys.stderr)


#: every method ``run_grids`` can time
METHODS = (*FOSCAR_BACKENDS, *baselines.BASELINES)
#: the methods timed by default
DEFAULT_METHODS = (
    "foscar-gluon",
    "foscar-gluon-e4m3",
    "foscar-triton",
    "foscar-reconstruct",
    "foscar-gluon-reconstruct",
    "flashinfer-bf16",
    "flashinfer-fp8",
    "trtllm-xqa-fp8",
    "sdpa-bf16",
)
#: the grids ``run_grids`` knows
GRIDS = ("main", "axes", "both", "quick")


def replot(path: str) -> str:
    """Rewrite the results file ``path`` and redraw its Markdown and PNG beside it from its
    rows (no GPU needed; the % column against its GPU's peak); returns the PNG's path."""
    with open(path) as f:
        stored = json.load(f)
    stem = os.path.splitext(path)[0]
    write_results(stored["rows"], stored["environment"], os.path.dirname(stem) or ".",
                  os.path.basename(stem))
    return stem + ".png"


def run_grids(
    grid: str = "main",
    *,
    methods=DEFAULT_METHODS,
    bits=(2, 4),
    iters: int = 30,
    head_dim: int = 128,
    page_size: int = 64,
    out_dir: str = ".",
    name: str | None = None,
    out=sys.stdout,
) -> dict[str, list[dict]]:
    """Time ``methods`` over ``grid`` (:data:`GRIDS`: "main", the 13-point grid with token-wise
    K/V; "axes", the four K/V axis combinations at B in {1, 8}, L in {32K, 128K}; "both"; or
    "quick", 2 points) on the GPU and write each grid's results under ``out_dir`` (named
    ``name`` or after the grid). Returns the rows of each grid by result name."""
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    shape = Shape(head_dim=head_dim, group_size=min(head_dim, 128), page_size=page_size)
    env = environment(torch.device("cuda"))
    env["shape"] = dataclasses.asdict(shape)
    print(json.dumps(env), file=out)
    jobs = []
    if grid in ("main", "both"):
        jobs.append(("decode_grid", MAIN_GRID, [AXES[0]], list(methods)))
    if grid in ("axes", "both"):
        axes_methods = ("foscar-triton", "foscar-gluon", "flashinfer-bf16")
        jobs.append(("decode_axes", AXES_GRID, AXES, [m for m in methods if m in axes_methods]))
    if grid == "quick":
        jobs.append(("decode_quick", [(1, 32768), (64, 16384)], [AXES[0]], list(methods)))
    results = {}
    for job, points, axes, job_methods in jobs:
        rows = run_grid(
            points, job_methods, axes=axes, bits_list=bits, iters=iters, shape=shape, out=out
        )
        default_name = job if head_dim == 128 else f"{job}_d{head_dim}"
        if page_size != 64:
            default_name += f"_p{page_size}"
        write_results(rows, env, out_dir, name or default_name)
        print(markdown_table(rows), file=out)
        results[name or default_name] = rows
    return results
