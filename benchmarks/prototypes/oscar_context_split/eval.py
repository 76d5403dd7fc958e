"""`foscar eval` with the rotations and GPTQ's rounding calibrated for different positions.

Session 19 (EVAL_NOTES 24): for INT2 keys everywhere at 4K, a calibration for the served
positions 0-4K gives the lowest perplexity, one for 0-2K (no RoPE shifts) the most needles
(16/49 against 10/49). Not the clips (they average 0.921 in both) and barely the rotation
choice (3 of 30 layers differ): the statistics behind every layer's rotation and behind
GPTQ's metric are what change. This splits them: ``--oscar-context`` shapes the rotations (the
calibration the candidates are built and selected from, as in `foscar eval`), while
``GPTQ_CONTEXT`` (environment; tokens, or "none" for the sequences' own positions) shapes the
GPTQ rows' metric (the queries' covariance C_Q under each rotation) and their clip fits.
Nothing else changes; the kernels are the shipped ones.

    GPTQ_CONTEXT=4096 python benchmarks/prototypes/oscar_context_split/eval.py [foscar eval args]
"""

from __future__ import annotations

import os
import sys

import foscar.oscar.evaluate as evaluate_module
from foscar.cli import main
from foscar.oscar.calibrate import calibrate
from foscar.oscar.positions import position_shifts

CONTEXT = os.environ.get("GPTQ_CONTEXT", "none")
_gptq_rows = evaluate_module.gptq_rows


def gptq_rows_at(model, sequences, calibration, full, selected_per_head, **kwargs):
    """:func:`foscar.oscar.evaluate.gptq_rows` with C_Q and the clip fits at ``CONTEXT``."""
    all_sequences = kwargs["metric_sequences"]
    seq_len = len(all_sequences[0])
    shifts = position_shifts(seq_len, None if CONTEXT == "none" else int(CONTEXT))
    log = kwargs.get("log") or (lambda s: None)
    log(f"GPTQ rows: C_Q and clip fits at the shifts {list(shifts)} (GPTQ_CONTEXT={CONTEXT})")
    at = calibrate(model, all_sequences, position_shifts=shifts, header=dict(calibration.header))
    kwargs["position_shifts"] = shifts
    return _gptq_rows(model, sequences, at, full, selected_per_head, **kwargs)


evaluate_module.gptq_rows = gptq_rows_at
print(f"GPTQ's metric and clips for positions: {CONTEXT}", flush=True)
sys.exit(main(["eval", *sys.argv[1:]]))
