"""The FlashInfer caches of the serving engine (:mod:`foscar.serving.flashinfer_kv`) on a CPU:
their pages, slots and plan, read by the torch reference attention, against attention computed
directly from the tokens; inside the continuous-batching engine against its own cache; and the
refusals where FlashInfer cannot run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import serve_requests, tiny_llama  # noqa: E402

from foscar.serving import StepRow, build_manager  # noqa: E402
from foscar.serving.flashinfer_kv import (  # noqa: E402
    E4M3_MAX,
    FlashInferPagedKV,
    flashinfer_bytes_per_token,
    serving_kv,
)

H_Q, H, D, PAGE = 4, 2, 16, 4


def _pool(storage="bf16", **kw):
    return FlashInferPagedKV(storage, num_layers=2, num_kv_heads=H, num_q_heads=H_Q, head_dim=D,
                             num_blocks=32, block_size=PAGE, attention="torch", **kw)


def _direct(q, keys, values, scale):
    """Causal attention of ``q [t, H_q, D]`` (the last ``t`` of the ``L`` positions) over
    ``keys, values [L, H, D]``, in float64."""
    t, length = q.shape[0], keys.shape[0]
    k = keys.double().repeat_interleave(H_Q // H, dim=1)
    v = values.double().repeat_interleave(H_Q // H, dim=1)
    logits = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    mask = torch.arange(length)[None, :] > torch.arange(length - t, length)[:, None]
    return torch.einsum("htl,lhd->thd", logits.masked_fill(mask, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_steps_attend_every_stored_token_through_the_pages(storage):
    """A prefill, then a step of a chunk on stored history, a decode row and a new prefill
    (pages out of order, padding after the rows): each row attends exactly its tokens."""
    torch.manual_seed(0)
    scale = 0.3 if storage == "fp8" else 1.0
    pool = _pool(storage, k_scale=scale, v_scale=scale) if storage == "fp8" else _pool(storage)
    history = {}  # request -> (keys, values) as stored (rounded)

    def rounded(x):
        if storage == "bf16":
            return x.to(torch.bfloat16).float()
        return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale

    blocks = {"a": (7, 2, 30, 11), "b": (5, 9), "c": (0, 3, 4)}
    steps = [[StepRow("a", 0, 6, blocks["a"])],
             [StepRow("a", 6, 5, blocks["a"]), StepRow("b", 0, 3, blocks["b"])],
             [StepRow("b", 3, 1, blocks["b"]), StepRow("c", 0, 9, blocks["c"]),
              StepRow("a", 11, 1, blocks["a"])]]
    for rows in steps:
        tokens = sum(r.query_length for r in rows)
        packed = tokens + 2  # padding rows after the requests'
        pool.begin_step(rows, num_tokens=packed)
        q = torch.randn(packed, H_Q, D)
        k, v = torch.randn(packed, H, D), torch.randn(packed, H, D)
        for layer in range(2):
            out = pool.attend(layer, q, k, v, scaling=D ** -0.5)
            assert out.shape == q.shape and out[tokens:].abs().sum() == 0  # padding: zeros
            start = 0
            for r in rows:
                t = slice(start, start + r.query_length)
                if layer == 0:
                    keys, values = history.get(r.request_id, (k[:0], v[:0]))
                    history[r.request_id] = (torch.cat([keys, rounded(k[t])]),
                                             torch.cat([values, rounded(v[t])]))
                keys, values = history[r.request_id]
                assert keys.shape[0] == r.past_length + r.query_length
                expected = _direct(q[t], keys, values, D ** -0.5)
                torch.testing.assert_close(out[t].double(), expected, atol=1e-5, rtol=1e-5)
                start += r.query_length


def test_fp8_saturates_and_bytes_per_token():
    pool = _pool("fp8")
    pool.begin_step([StepRow("a", 0, 2, (1,))])
    k = torch.tensor([1000.0, -3.0]).view(2, 1, 1).expand(2, H, D).contiguous()
    pool.attend(0, torch.zeros(2, H_Q, D), k, k, scaling=D ** -0.5)
    stored = pool.k_pages[0][1, :2].float()
    assert stored[0].max() == E4M3_MAX and stored[1].min() == -3.0
    assert flashinfer_bytes_per_token("fp8", 36, 8, 128) == 36 * 2 * 8 * 128
    assert flashinfer_bytes_per_token("bf16", 36, 8, 128) == 36 * 2 * 8 * 128 * 2
    assert pool.pool_bytes() == 2 * 2 * 33 * PAGE * H * D  # layers x (K, V) x pages (+ scratch)


@pytest.mark.parametrize("rows, message", [
    ([StepRow("a", 0, 9, (1, 2))], "need 3 block ids"),
    ([StepRow("a", 0, 3, (40,))], "outside the pool"),
    ([StepRow("a", 5, 1, (1, 2))], "holds no tokens"),
    ([StepRow("a", 0, 0, (1,))], "query_length must be >= 1"),
])
def test_bad_steps_are_refused(rows, message):
    with pytest.raises(ValueError, match=message):
        _pool().begin_step(rows)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="storage must be one of"):
        FlashInferPagedKV("int8", num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=8,
                          num_blocks=1, block_size=4, attention="torch")
    with pytest.raises(ValueError, match="apply to storage='fp8' only"):
        _pool("bf16", k_scale=0.5)
    with pytest.raises(ValueError, match="need a CUDA device"):
        FlashInferPagedKV("bf16", num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=8,
                          num_blocks=1, block_size=4)
    pool = _pool()
    pool.begin_step([StepRow("a", 0, 2, (1,))])
    with pytest.raises(ValueError, match="scales logits by 0.5"):
        pool.attend(0, torch.zeros(2, H_Q, D), torch.zeros(2, H, D), torch.zeros(2, H, D),
                    scaling=0.5)


def test_the_engine_serves_the_same_answers_through_the_pages():
    """In the engine (torch reference attention, the model in float32): the FlashInfer caches'
    greedy answers equal the engine's own cache's, steps mixing prefill, chunks and decode."""
    torch.set_num_threads(1)
    model = tiny_llama(layers=2, q_heads=4, kv_heads=2, head_dim=32)
    g = torch.Generator().manual_seed(1)
    requests = [(torch.randint(3, 96, (n,), generator=g).tolist(),
                 dict(max_new_tokens=6, eos_token_id=-1)) for n in (5, 40, 23, 70)]
    answers = {}
    for kv in ("bf16", "flashinfer-bf16", "flashinfer-fp8"):
        manager = build_manager(model, kv, num_blocks=64, block_size=16, max_batch_tokens=32,
                                backend="reference")
        answers[kv] = [r.generated_tokens for r in serve_requests(manager, requests,
                                                                  staggered=True)]
        stats = manager.kv_stats()
        assert stats["kv"] == kv and stats["max_tokens"] == 64 * 16
        if kv != "bf16":  # the pages live requests held at once: at least the longest's 76 tokens
            assert 5 <= stats["peak_pages"] <= 64
    assert answers["flashinfer-bf16"] == answers["bf16"] == answers["flashinfer-fp8"]
    assert "torch reference attention" in stats["attention"]


def test_refused_without_flashinfer_and_the_serve_choice():
    model = tiny_llama(layers=1, q_heads=2, kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="kv='flashinfer-fp8': FlashInfer's kernels need a CUDA"):
        build_manager(model, "flashinfer-fp8", num_blocks=8)
    kv, why = serving_kv("bf16", "cpu", torch.float32)
    assert kv == "sdpa-bf16" and "paged SDPA path serve instead" in why
    with pytest.raises(ValueError, match="--kv fp8 runs on FlashInfer's kernels: .*CUDA device"):
        serving_kv("fp8", "cpu", torch.bfloat16)


def test_foscar_serve_refuses_fp8_before_loading_a_model(capsys):
    from foscar.commands.serve import SERVE_MODULES, serve_main

    for module in SERVE_MODULES:  # without the serve extra, that is the error it reports first
        pytest.importorskip(module, reason="foscar serve needs the serve extra")
    assert serve_main(["--kv", "fp8", "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("foscar serve: error: --kv fp8 runs on FlashInfer's kernels: FlashInfer's "
                       "kernels need a CUDA device; the model is on cpu")
    assert not any("loading" in line for line in err)


def needs_flashinfer(test):
    """A GPU test (conftest's one CUDA check) that also needs the flashinfer package."""
    test = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                              reason="FlashInfer's kernels need the flashinfer package")(test)
    return pytest.mark.gpu(reason="FlashInfer's kernels")(test)


def _gpu_pools(storage, **kw):
    """The same pool attended by FlashInfer and by the torch reference (bf16 model inputs)."""
    args = dict(num_layers=2, num_kv_heads=8, num_q_heads=32, head_dim=128, num_blocks=24,
                block_size=16, device="cuda")
    return (FlashInferPagedKV(storage, attention="flashinfer", **args, **kw),
            FlashInferPagedKV(storage, attention="torch", **args))


def _inputs(tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(tokens, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for h in (32, 8, 8)]


@needs_flashinfer
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_flashinfer_attends_as_the_reference(storage):
    """Prefill, a chunk with a decode row and a new prefill, then decode-only steps: FlashInfer's
    wrappers against the torch reference over the same pages."""
    fast, ref = _gpu_pools(storage)
    blocks = {"a": (3, 17, 5, 9, 11), "b": (0, 21), "c": (7, 8, 2)}
    steps = [[StepRow("a", 0, 37, blocks["a"])],
             [StepRow("a", 37, 20, blocks["a"]), StepRow("b", 0, 5, blocks["b"])],
             [StepRow("b", 5, 1, blocks["b"]), StepRow("c", 0, 40, blocks["c"])],
             [StepRow("a", 57, 1, blocks["a"]), StepRow("b", 6, 1, blocks["b"]),
              StepRow("c", 40, 1, blocks["c"])]]
    for i, rows in enumerate(steps):
        q, k, v = _inputs(sum(r.query_length for r in rows), i)
        fast.begin_step(rows)
        ref.begin_step(rows)
        for layer in range(2):
            got = fast.attend(layer, q, k, v, scaling=128 ** -0.5)
            want = ref.attend(layer, q, k, v, scaling=128 ** -0.5)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_flashinfer
def test_flashinfer_decode_step_replays_in_a_cuda_graph():
    """A decode-only step padded to 8 rows captured once and replayed for the next step (its
    plan refreshed by begin_step): the replay equals the reference's eager step."""
    fast, ref = _gpu_pools("bf16", cuda_graphs=True, max_step_tokens=8)
    blocks = {"a": (3, 17, 5), "b": (0, 21)}
    for pool in (fast, ref):
        pool.begin_step([StepRow("a", 0, 30, blocks["a"]), StepRow("b", 0, 12, blocks["b"])])
        q, k, v = _inputs(42, 0)
        for layer in range(2):
            pool.attend(layer, q, k, v, scaling=128 ** -0.5)
    q, k, v = _inputs(8, 1)
    static = [t.clone() for t in (q, k, v)]
    rows = [StepRow("a", 30, 1, blocks["a"]), StepRow("b", 12, 1, blocks["b"])]
    fast.begin_step(rows, num_tokens=8)
    assert fast.step_capturable
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a first run outside the capture builds the kernels
        fast.attend(0, *static, scaling=128 ** -0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fast.attend(layer, *static, scaling=128 ** -0.5) for layer in range(2)]
    graph.replay()  # the captured step itself: its tokens written in every layer
    # the next step: new tokens, the plan refreshed, the graph replayed
    rows = [StepRow("a", 31, 1, blocks["a"]), StepRow("b", 13, 1, blocks["b"])]
    q, k, v = _inputs(8, 2)
    for t, new in zip(static, (q, k, v)):
        t.copy_(new)
    fast.begin_step(rows, num_tokens=8)
    graph.replay()
    ref.begin_step([StepRow("a", 30, 1, blocks["a"]), StepRow("b", 12, 1, blocks["b"])])
    q0, k0, v0 = _inputs(8, 1)
    for layer in range(2):
        ref.attend(layer, q0[:2], k0[:2], v0[:2], scaling=128 ** -0.5)
    ref.begin_step(rows)
    for layer in range(2):
        want = ref.attend(layer, q[:2], k[:2], v[:2], scaling=128 ** -0.5)
        torch.testing.assert_close(outs[layer][:2].float(), want.float(), atol=2e-2, rtol=2e-2)
