# ruff: noqa: E501
"""Per-layer held-out INT2 key error by calibration positions (EVAL_NOTES 23), from run.py's JSON.

    python benchmarks/prototypes/oscar_rope_positions/plot.py benchmarks/results/cpu/oscar_rope_positions/rope_positions.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = Path(sys.argv[1])
rows = json.loads(path.read_text())["rows"]
labels = {
    "2k": "4 x 2,048 (positions 0-2K)",
    "2k+shift4k": "4 x 2,048 shifted over 0-4K",
    "2k+shift8k": "4 x 2,048 shifted over 0-8K",
    "4k": "2 x 4,096",
    "8k": "1 x 8,192",
}
fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for ax, held in zip(axes, ("4k", "8k")):
    for name, label in labels.items():
        r = rows[f"{held}/{name}/kk"]
        style = "--" if name in ("4k", "8k") else "-"
        ax.plot(r["per_layer"], style, marker=".", label=f"{label}: mean {r['mean']:.3f}")
    ax.set_title(f"held-out queries at {held.upper()} positions (FOSCAR paper)")
    ax.set_xlabel("layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
axes[0].set_ylabel("attention-output error (K alone INT2)")
fig.suptitle("SmolLM2-135M: INT2 key error by the positions the key statistics were taken at (K^TK per KV head, U*H*P_br)", fontsize=9)
fig.tight_layout()
out = path.with_suffix(".png")
fig.savefig(out, dpi=120)
print(f"wrote {out}")
