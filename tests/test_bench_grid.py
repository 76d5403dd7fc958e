"""foscar bench on a CPU: what runs without a GPU (tables and plots from stored results)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from foscar.bench.grid import markdown_table, peak_tbps, speedups

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


def _rows(name):
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        return json.load(f)["rows"]


def test_speedups_are_against_flashinfer_bf16_at_the_same_point():
    rows = [dict(r) for r in _rows("decode_grid")]
    for r in rows:
        r.pop("speedup_vs_flashinfer_bf16", None)
    speedups(rows)
    base = {(r["batch"], r["kv_len"]): r["ms"] for r in rows if r["method"] == "flashinfer-bf16"}
    for r in rows:
        want = base[(r["batch"], r["kv_len"])] / r["ms"]
        assert r["speedup_vs_flashinfer_bf16"] == pytest.approx(want)
    assert "geomean speedup" in markdown_table(rows)


def test_replot_redraws_the_png_without_a_gpu(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "decode_grid.json"
    shutil.copy(os.path.join(RESULTS, "decode_grid.json"), src)
    subprocess.run([sys.executable, "-m", "foscar", "bench", "--replot", str(src)], check=True)
    png = tmp_path / "decode_grid.png"
    assert png.stat().st_size > 10_000
    assert "% of the GPU's 4.8 TB/s" in (tmp_path / "decode_grid.md").read_text()  # an H200's


def test_percent_of_peak_is_the_measuring_gpus():
    """The % column divides by the datasheet bandwidth of the GPU that ran the grid (an H100's
    3.35 TB/s, not the H200's 4.8), and is left out for a GPU the table does not know."""
    assert peak_tbps("NVIDIA H100 80GB HBM3") == 3.35 and peak_tbps("NVIDIA H200") == 4.8
    assert peak_tbps("NVIDIA A100-SXM4-80GB") is None and peak_tbps(None) is None
    assert peak_tbps("NVIDIA GH200 480GB") is None  # not an H200's
    rows = [dict(r) for r in _rows("decode_grid_h100")]
    speedups(rows, peak=3.35)
    r = next(r for r in rows if r["method"] == "flashinfer-bf16" and r["kv_len"] == 131072
             and r["batch"] == 64)
    assert r["pct_peak"] == pytest.approx(100 * r["tbps"] / 3.35)
    assert "% of the GPU's 3.35 TB/s" in markdown_table(rows, 3.35)
    speedups(rows)
    table = markdown_table(rows)
    assert "%" not in table and "1.00x" in table
