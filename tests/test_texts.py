"""The texts of ``foscar eval`` and ``foscar calibrate``: the default ships inside the package,
and a user's files replace it."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from foscar.eval import texts

ROOT = Path(__file__).resolve().parents[1]
#: sha256 of the shipped text: results name it as their calibration and evaluation text
DEFAULT_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"


def test_default_text_resolves_inside_the_package(tmp_path):
    """From any folder, with nothing beside the package: the text is package data, found by
    importlib.resources, and is the text results were made with."""
    code = (
        "import hashlib, pathlib, foscar\n"
        "from importlib import resources\n"
        "from foscar.eval.texts import python_reference\n"
        "path = resources.files('foscar').joinpath('data').joinpath('python-reference.txt')\n"
        "assert path.is_file()\n"
        "assert pathlib.Path(str(path)).is_relative_to(pathlib.Path(foscar.__file__).parent)\n"
        "print(hashlib.sha256(python_reference().text.encode()).hexdigest())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FOSCAR_PAPERS"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == DEFAULT_SHA256
    license_note = ROOT / "foscar" / "data" / "LICENSE-python-reference.txt"
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in license_note.read_text()


def test_the_package_reads_nothing_outside_itself():
    sources = [p.read_text() for p in (ROOT / "foscar").rglob("*.py")]
    assert not any("../shared" in s or "FOSCAR_PAPERS" in s for s in sources)


def test_read_texts_joins_the_files_in_order(tmp_path):
    a, b, empty = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "empty.txt"
    a.write_text("first")
    b.write_text("second")
    empty.write_text("  \n")
    text = texts.read_texts([a, b])
    assert text.text == "first\n\nsecond" and text.source == f"{a}, {b}"
    assert texts.read_texts([str(a)]).text == "first"
    with pytest.raises(ValueError, match="--text .*empty.txt' is empty"):
        texts.read_texts([a, empty])
    with pytest.raises(ValueError, match="--text .*missing.txt' cannot be read"):
        texts.read_texts([tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="--text needs at least one file"):
        texts.read_texts([])


def test_default_text_sha_is_the_shipped_file():
    data = (ROOT / "foscar" / "data" / texts.DEFAULT_TEXT).read_bytes()
    assert hashlib.sha256(data).hexdigest() == DEFAULT_SHA256
    assert texts.python_reference().text.encode() == data


@pytest.mark.slow
def test_a_wheel_carries_the_default_text_and_the_command(tmp_path):
    """A non-editable install gets the text: the wheel built from the package holds it, and
    the ``foscar`` script points at the command line."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "foscar", src / "foscar", ignore=shutil.ignore_patterns("__pycache__"))
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (wheel,) = (tmp_path / "dist").glob("foscar-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {
            f"foscar/data/{texts.DEFAULT_TEXT}",
            "foscar/data/LICENSE-python-reference.txt",
        } <= (names)
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        assert "foscar = foscar.commands.main:main" in z.read(entry).decode()
