"""How the stress input's two unspecified knobs move the quantization errors (CPU, ~2 min).

    python benchmarks/stress_sweep.py > benchmarks/results/cpu/stress_sweep.md

The paper (Sec. 6.2) amplifies eight K channels and ramps K's per-token scale without saying
by how much; `foscar demo` uses gain 2 and ramp 1 -> 2. This sweeps both (L = 4096, batch 1).
"""

import io

from foscar.demo import run_demo

SETTINGS = [
    (2.0, (1.0, 1.0)),
    (2.0, (1.0, 2.0)),
    (2.0, (0.25, 2.0)),
    (4.0, (1.0, 2.0)),
    (10.0, (1.0, 2.0)),
    (10.0, (0.25, 2.0)),
]


def main() -> None:
    rows = {}
    names = None
    for gain, ramp in SETTINGS:
        result = run_demo(length=4096, batch=1, outlier_gain=gain, ramp=ramp, out=io.StringIO())
        names = [r["format"] for r in result]
        rows[(gain, ramp)] = {r["format"]: r["rel_l2_vs_fp32"] for r in result}
    print(
        "| format | "
        + " | ".join(f"gain {g:g}, ramp {a:g}->{b:g}" for g, (a, b) in SETTINGS)
        + " |"
    )
    print("|---" * (len(SETTINGS) + 1) + "|")
    for name in names:
        print(f"| {name} | " + " | ".join(f"{rows[s][name]:.3f}" for s in SETTINGS) + " |")
    print(
        "\nRelative L2 error of the decode output against fp32 attention over the unquantized "
        "cache; L = 4096, batch 1, H_Q = 32, H_KV = 8, D = 128, g = 128."
    )


if __name__ == "__main__":
    main()
