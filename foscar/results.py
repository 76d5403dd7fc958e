"""Results files: the JSON every measuring command writes (``foscar eval``, ``foscar bench``).

Indented one level per nesting, as people read them, but a list of plain numbers on one line:
per-position NLLs, per-request times and token ids would otherwise take a line per number
(about a third of a results file's bytes).
"""

from __future__ import annotations

import json
import re

__all__ = ["results_json"]

# a JSON array whose items are numbers only (ints, floats, exponents, negatives), as
# json.dumps(indent=...) lays it out over lines
_NUMBER_LIST = re.compile(r"\[\s*(-?[0-9][0-9.eE+-]*(?:\s*,\s*-?[0-9][0-9.eE+-]*)*)\s*\]")


def results_json(obj) -> str:
    """``obj`` as JSON indented by one space per level, lists of numbers on one line, with a
    final newline; ``json.loads`` of it gives ``obj`` back."""
    text = json.dumps(obj, indent=1)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(re.split(r"\s*,\s*", m.group(1))) + "]",
                            text) + "\n"
