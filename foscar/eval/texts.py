"""The texts ``foscar eval`` and ``foscar calibrate`` read, and where each comes from.

By default one text shipped inside the package: ``foscar/data/python-reference.txt``, CPython's
language reference as ``help()`` shows it (the topics of CPython 3.11.7's
``pydoc_data.topics``, in sorted order; about 113K SmolLM2 tokens; Python Software Foundation
License, ``foscar/data/LICENSE-python-reference.txt``). Its token ranges are kept apart, so no
calibration reads what is scored:

=================  ============================================================================
use                tokens of the default text
=================  ============================================================================
calibration        from token 0 (``foscar eval``'s clip ratios, OSCAR's rotations and
                   ``foscar calibrate``)
needle haystack    from token :data:`NEEDLE_OFFSET`
perplexity         from token :data:`EVAL_OFFSET`: scored windows after the first
                   ``PPL_OFFSET`` tokens of this range and the longest prefix
greedy agreement   prose passages after the scored windows
=================  ============================================================================

``foscar eval --text FILE`` replaces the evaluation text: the perplexity windows and agreement
passages read the file as they read the range above, and the needle haystack is the file from
its start; calibration keeps the default text. ``foscar calibrate --text FILE`` calibrates on
the file instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

__all__ = [
    "Text",
    "encode",
    "python_reference",
    "read_texts",
    "DEFAULT_TEXT",
    "NEEDLE_OFFSET",
    "EVAL_OFFSET",
]

#: the shipped default text, a file of the package's ``data`` folder
DEFAULT_TEXT = "python-reference.txt"
#: token of the default text where the needle haystack starts (calibration reads its start)
NEEDLE_OFFSET = 40000
#: token of the default text where the perplexity and agreement text starts (room for 16K
#: tokens of haystack before it)
EVAL_OFFSET = 56000


@dataclass(frozen=True)
class Text:
    """A text and a description of where it comes from (recorded in results)."""

    name: str
    text: str
    source: str


@functools.cache
def python_reference() -> Text:
    """CPython's language reference (``help()``'s topics), shipped with foscar."""
    data = resources.files("foscar").joinpath("data").joinpath(DEFAULT_TEXT).read_bytes()
    return Text(
        "python-reference",
        data.decode("utf-8"),
        f"{DEFAULT_TEXT} (CPython 3.11.7's language reference, shipped with foscar)",
    )


def read_texts(paths: Sequence[str | os.PathLike]) -> Text:
    """The user's text: the files of ``paths``, in order, joined by a blank line.

    Raises ``ValueError`` naming ``--text`` when a file is missing, unreadable or empty.
    """
    if not paths:
        raise ValueError("--text needs at least one file")
    parts = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--text {str(path)!r} cannot be read as UTF-8 text: {e}") from None
        if not text.strip():
            raise ValueError(f"--text {str(path)!r} is empty")
        parts.append(text)
    names = ", ".join(os.path.basename(os.fspath(p)) for p in paths)
    return Text(names, "\n\n".join(parts), ", ".join(os.fspath(p) for p in paths))


def encode(tokenizer, text: str) -> list[int]:
    """The token ids of ``text`` without special tokens, as every text foscar reads is
    tokenized (evaluation ranges, prompts, needles)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
