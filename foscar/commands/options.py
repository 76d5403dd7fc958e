"""Argument types shared by the subcommands: each checks a value when the command line is
parsed, before any work, and a bad one becomes argparse's one-line error naming the option."""

from __future__ import annotations

import argparse
import os


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number strictly between 0 and 1."""
    value = _float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def existing_file(text: str) -> str:
    """A path to an existing file."""
    if not os.path.isfile(text):
        what = "is a folder" if os.path.isdir(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"expected a file, but {text!r} {what}")
    return text


def existing_path(text: str) -> str:
    """A path to an existing file or folder."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def output_file(text: str) -> str:
    """A file to write: not a folder, in a folder that exists or can be made."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file name, but {text!r} is a folder")
    _check_creatable(os.path.dirname(os.path.abspath(text)), text)
    return text


def output_folder(text: str) -> str:
    """A folder to write into: an existing folder, or one that can be made."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a folder, but {text!r} is a file")
    _check_creatable(os.path.abspath(text), text)
    return text


def _check_creatable(folder: str, text: str) -> None:
    """The nearest existing parent of ``folder`` must be a folder we may write into."""
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {parent!r} is a file")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {parent!r} is not writable")


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, the CUDA ones only where torch sees such a GPU."""
    import torch

    name, _, index = text.partition(":")
    if name not in ("cpu", "cuda") or (index and (name == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if name == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            raise argparse.ArgumentTypeError(
                f"{text!r} is not available (torch {torch.__version__}: {build}); use cpu"
            )
        if index and int(index) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not available ({torch.cuda.device_count()} CUDA devices)"
            )
    return text
