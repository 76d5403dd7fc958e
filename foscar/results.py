"""Results files: the JSON every measuring command writes (``foscar eval``, ``foscar bench``).

Indented one level per nesting, as people read them, but a list of plain numbers on one line:
per-position NLLs, per-request times and token ids would otherwise take a line per number
(a third to half of an evaluation's JSON). A float that is a float32 value (per-position NLLs
come from float32 tensors) is written with the fewest digits that read back as that float32
(at most 9, where its float64 repr takes up to 17): the file holds what was measured and half
the digits.
"""

from __future__ import annotations

import json
import math
import re
import struct

__all__ = ["results_json", "shortest_float32"]

# a JSON string (left as it is: its text may hold brackets and numbers), or an array whose items
# are numbers only (ints, floats, exponents, negatives), as json.dumps(indent=...) lays it out
_STRING_OR_NUMBER_LIST = re.compile(
    r'"(?:[^"\\]|\\.)*"'
    r"|\[\s*(-?[0-9][0-9.eE+-]*(?:\s*,\s*-?[0-9][0-9.eE+-]*)*)\s*\]"
)


def _one_line(match: re.Match) -> str:
    numbers = match.group(1)
    if numbers is None:  # a string
        return match.group(0)
    return "[" + ", ".join(re.split(r"\s*,\s*", numbers)) + "]"


def _as_float32(x: float) -> float:
    """``x`` rounded to float32 (``struct``'s IEEE single)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def shortest_float32(x: float) -> float:
    """``x`` itself, unless it is a finite float32 value: then the float of the fewest
    significant digits (1 to 9) that rounds to the same float32, so JSON writes those digits."""
    if not math.isfinite(x) or abs(x) > 3.4e38 or _as_float32(x) != x:
        return x
    for digits in range(1, 10):
        short = float(f"{x:.{digits}g}")
        if _as_float32(short) == x:
            return short
    return x


def _short_floats(obj):
    if isinstance(obj, float):
        return shortest_float32(obj)
    if isinstance(obj, dict):
        return {k: _short_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_short_floats(v) for v in obj]
    return obj


def results_json(obj) -> str:
    """``obj`` as JSON indented by one space per level, lists of numbers on one line, with a
    final newline, float32 values in their shortest digits (:func:`shortest_float32`):
    ``json.loads`` of it gives ``obj`` back, each such float to the same float32."""
    text = json.dumps(_short_floats(obj), indent=1)
    return _STRING_OR_NUMBER_LIST.sub(_one_line, text) + "\n"
