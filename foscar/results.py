"""Results files: the JSON every measuring command writes (``foscar eval``, ``foscar bench``).

Indented one level per nesting, as people read them, but a list of plain numbers on one line:
per-position NLLs, per-request times and token ids would otherwise take a line per number
(a third to half of an evaluation's JSON).
"""

from __future__ import annotations

import json
import re

__all__ = ["results_json"]

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


def results_json(obj) -> str:
    """``obj`` as JSON indented by one space per level, lists of numbers on one line, with a
    final newline; ``json.loads`` of it gives ``obj`` back."""
    return _STRING_OR_NUMBER_LIST.sub(_one_line, json.dumps(obj, indent=1)) + "\n"
