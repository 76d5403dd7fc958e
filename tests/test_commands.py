"""The ``foscar`` command line: bad values end as one argparse-style error line and exit status
2, before any work and without a traceback; every option says what it does."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import pytest
from conftest import HAS_CUDA

from foscar.commands.main import COMMANDS, build_parser, main

NO_CUDA = not HAS_CUDA


def cli_error(capsys, argv: list[str]) -> str:
    """``foscar *argv``'s error line: exit status 2, one line naming the problem, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"foscar {argv[0]}: error: "), err
    return line


CASES = [
    (["demo", "--batch", "0"], "argument --batch: expected an integer >= 1, got '0'"),
    (["demo", "--length", "-5"], "argument --length: expected an integer >= 1, got '-5'"),
    (["demo", "--length", "1k"], "argument --length: expected an integer, got '1k'"),
    (["demo", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["demo", "--outlier-gain", "0"], "argument --outlier-gain: expected a number > 0"),
    (["demo", "--ramp", "1", "x"], "argument --ramp: expected a number, got 'x'"),
    (["demo", "--seed", "a"], "argument --seed: invalid int value: 'a'"),
    (
        ["bench", "--replot", "/missing.json"],
        "argument --replot: expected a file, but '/missing.json' does not exist",
    ),
    (["bench", "--iters", "0"], "argument --iters: expected an integer >= 1, got '0'"),
    (["bench", "--bits", "3"], "argument --bits: invalid choice: 3"),
    (["bench", "--methods", "nope"], "argument --methods: invalid choice: 'nope'"),
    (["bench", "--head-dim", "60"], "argument --head-dim: expected a multiple of 16 up to 256"),
    (["bench", "--page-size", "48"], "argument --page-size: invalid choice: 48"),
    (["bench", "--out", "/etc/hostname/x"], "argument --out: cannot write '/etc/hostname/x'"),
    (["bench", "--e2e-new-tokens", "0"], "argument --e2e-new-tokens: expected an integer >= 1"),
    (["bench", "--e2e-warmup", "-1"], "argument --e2e-warmup: expected an integer >= 0"),
    (["bench", "--e2e-contexts", "0"], "argument --e2e-contexts: expected an integer >= 1"),
    (["bench", "--e2e-kv-budget-gib", "0"], "argument --e2e-kv-budget-gib: expected a number > 0"),
    (["bench", "--e2e-methods", "fp4"], "argument --e2e-methods: invalid choice: 'fp4'"),
    (["eval", "--model", "/missing"], "argument --model: '/missing' does not exist"),
    (["eval", "--text", "/missing.txt"], "argument --text: expected a file, but '/missing.txt'"),
    (["eval", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["eval", "--ppl-tokens", "0"], "argument --ppl-tokens: expected an integer >= 1, got '0'"),
    (["eval", "--ppl-prefixes", "0"], "argument --ppl-prefixes: expected an integer >= 1"),
    (["eval", "--needle-depths", "1.5"], "argument --needle-depths: expected a number in (0, 1)"),
    (["eval", "--needle-lengths", "-1"], "argument --needle-lengths: expected an integer >= 1"),
    (["eval", "--calibration-tokens", "0"], "argument --calibration-tokens: expected an integer"),
    (["eval", "--metrics", "bleu"], "argument --metrics: invalid choice: 'bleu'"),
    (["eval", "--from-json", "/missing.json"], "argument --from-json: expected a file, but"),
    (["eval", "--oscar-windows", "64", "-1"], "argument --oscar-windows: expected an integer >= 0"),
    (["eval", "--oscar-int4-layers", "0:4"], "argument --oscar-int4-layers: N (INT4 key layers)"),
    (["eval", "--ppl-windows", "4096:0x3"], "--ppl-windows '4096:0x3': S and M must be >= 1"),
    (["eval", "--ppl-windows", "4096-3"], "--ppl-windows takes PREFIX:SxM"),
    (["eval", "--ppl-windows", "999:2x3"], "--ppl-windows '999:2x3': 999 is not one of"),
    (["eval", "--ppl-first", "500", "--metrics", "needle"], "--metrics must include ppl"),
    (["eval", "--oscar-context", "4096"], "--oscar-context shapes the calibration of --oscar"),
    (["eval", "--oscar-int4-layers", "6"], "--oscar-int4-layers picks rows of --oscar-gptq"),
    (["calibrate", "--tokens", "0"], "argument --tokens: expected an integer >= 1, got '0'"),
    (["calibrate", "--model", "/missing"], "argument --model: '/missing' does not exist"),
    (["calibrate", "--text", "/missing.txt"], "argument --text: expected a file, but"),
]
if NO_CUDA:
    CASES += [
        (["demo", "--device", "cuda"], "argument --device: 'cuda' is not available"),
        (["eval", "--device", "cuda:0"], "argument --device: 'cuda:0' is not available"),
        (["calibrate", "--device", "cuda"], "argument --device: 'cuda' is not available"),
        (["bench"], "the kernel grid needs a CUDA GPU"),
    ]


@pytest.mark.parametrize("argv, says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_values_end_as_one_error_line(capsys, argv, says):
    assert says in cli_error(capsys, argv)


def test_a_results_file_that_is_not_json_is_one_error_line(capsys, tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text("{not json")
    line = cli_error(capsys, ["eval", "--from-json", str(bad)])
    assert f"--from-json '{bad}' is not JSON" in line


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal of cuda where torch sees none")
def test_refusal_comes_before_any_work():
    """As a user runs it: the process exits 2 with the error line, without the seconds of work
    a demo takes before its first decode."""
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "foscar", "demo", "--device", "cuda"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("foscar demo: error: argument --device")
    assert "stress input" not in res.stdout  # the demo's first step never ran
    assert time.perf_counter() - t0 < 60


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        elif not isinstance(action, argparse._HelpAction):
            yield parser.prog, action


def test_every_option_has_help_without_development_history():
    history = re.compile(r"\bsession|\bissue \d|NOTES|\bs\d{1,2}-[a-z]", re.I)
    seen = set()
    for prog, action in _actions(build_parser()):
        if action.dest in ("command",):
            continue
        seen.add(prog.split()[-1])
        assert action.help, f"{prog} {action.option_strings} has no help text"
        assert not history.search(action.help), (prog, action.option_strings, action.help)
    assert seen == set(COMMANDS)


def test_a_subcommand_is_a_module_with_help_arguments_and_run():
    for name, module in COMMANDS.items():
        assert module.HELP and callable(module.add_arguments) and callable(module.run), name
