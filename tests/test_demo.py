"""`foscar demo` runs end to end on the CPU and shows the paper's ordering of errors."""

import io
import subprocess
import sys

from foscar.demo import run_demo


def test_demo_table_and_ordering():
    out = io.StringIO()
    rows = {r["format"]: r for r in run_demo(length=2048, batch=1, out=out)}
    text = out.getvalue()
    assert "rel L2 vs fp32" in text and "[13/13]" in text
    assert len(rows) == 11
    assert rows["BF16"]["bits_per_element"] == 16
    assert rows["INT2 token min-max"]["bits_per_element"] == 2.5
    assert rows["INT4 channel clipped"]["bits_per_element"] == 4.5
    # the decode arithmetic is exact up to the bf16 output rounding
    assert all(r["rel_l2_vs_dequantized"] < 5e-3 for r in rows.values())
    # quantization error: BF16 << INT4 < INT2, and clipping helps INT2 token-wise
    assert rows["BF16"]["rel_l2_vs_fp32"] < 5e-3
    int4 = max(rows[f"INT4 {a} min-max"]["rel_l2_vs_fp32"] for a in ("token", "channel"))
    int2 = min(r["rel_l2_vs_fp32"] for name, r in rows.items() if name.startswith("INT2"))
    assert int4 < 0.3 < int2
    assert (
        rows["INT2 token clipped"]["rel_l2_vs_fp32"]
        < 0.8 * rows["INT2 token min-max"]["rel_l2_vs_fp32"]
    )


def test_cli_entry_point_parses():
    res = subprocess.run(
        [sys.executable, "-m", "foscar", "demo", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--length" in res.stdout and "--outlier-gain" in res.stdout
