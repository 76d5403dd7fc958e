"""foscar bench on a CPU: what runs without a GPU (tables and plots from stored results)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from foscar.bench.grid import markdown_table, speedups

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
