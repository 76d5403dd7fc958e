"""The Triton extend kernel (a chunk's queries over a request's quantized pages, its BF16 windows
and the chunk itself, bottom-right causal) against the float64 reference: the history
dequantized, then softmax attention with the chunk's token i seeing every stored token and the
chunk's tokens 0..i.

On a CPU machine the kernel runs in the Triton interpreter (conftest sets TRITON_INTERPRET=1;
the kernel computes with fp32 operands holding bf16 values there). Outputs are poisoned with NaN
before each call, so an unwritten element fails.
"""

import math

import pytest
import torch
from conftest import KERNEL_DEVICE
from kernel_cases import rel_l2

from foscar import KVFormat, QuantFormat, QuantizedKVCache, triton_runtime
from foscar.backends.extend import ExtendConfig, extend_attention, extend_splits
from foscar.reference import dequantize_sequence

pytest.importorskip("triton")

HEAD_DIM = 64  # the smallest head_dim the kernels take: the interpreter's time grows with it
PAGE = 16
NUM_KV_HEADS = 2


def random_orthogonal(d, seed):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q


def make_cache(fmt, history, *, seed=0, rotate=False, other=37):
    """A cache holding the request (row 0) with ``history`` stored tokens, written as a prefill
    and two single-token steps, beside another request of ``other`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [history, other]
    cache = QuantizedKVCache(
        fmt,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        num_pages=sum(math.ceil((n + 2) / PAGE) for n in lengths) + 3,
        max_seqs=2,
        page_size=PAGE,
        device=KERNEL_DEVICE,
    )
    if rotate:
        rk, rv = random_orthogonal(HEAD_DIM, 1), random_orthogonal(HEAD_DIM, 2)
        cache.set_transform(0, key_rotation=rk, value_rotation=rv)
    ids = [cache.add_sequence() for _ in lengths]
    spread = torch.linspace(0.3, 2.0, HEAD_DIM)
    for seq, n in zip(ids, lengths):
        steps = [n - 2, 1, 1] if n > 2 else [n]
        for m in steps:
            if m == 0:
                continue
            k = torch.randn(m, NUM_KV_HEADS, HEAD_DIM, generator=g) * spread + 0.3
            v = torch.randn(m, NUM_KV_HEADS, HEAD_DIM, generator=g) * spread.flip(0) - 0.2
            cache.append([seq], k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), [m])
    return cache, cache.plan(ids)


def chunk(t, ratio, seed=3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, NUM_KV_HEADS * ratio, HEAD_DIM, generator=g) * 1.5
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g) + 0.3
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=g)
    # bf16 values in any dtype: a GPU rounds the query to bf16 operands
    return tuple(x.bfloat16().to(KERNEL_DEVICE, dtype) for x in (q, k, v))


def reference(cache, batch, row, q, k, v, sm_scale, *, bf16=False, mask=None):
    """``[T, H_q, D]`` float64: the stored tokens dequantized (model coordinates) and the
    chunk, bottom-right causal. ``bf16``: what a plain bf16 attention computes over the same
    values (keys, values and probabilities rounded to bf16): the error bar."""
    t, hq, _ = q.shape
    ratio = hq // NUM_KV_HEADS
    k_past, v_past = dequantize_sequence(cache, batch, row, torch.float64)
    keys = torch.cat([k_past.cpu(), k.cpu().double().transpose(0, 1)], dim=1)
    vals = torch.cat([v_past.cpu(), v.cpu().double().transpose(0, 1)], dim=1)
    heads = torch.arange(hq) // ratio
    keys, vals = keys[heads], vals[heads]
    past = k_past.shape[1]
    seen = torch.arange(past + t)[None, :] <= past + torch.arange(t)[:, None]
    if mask is not None:
        seen = seen & torch.cat([torch.ones(past, dtype=torch.bool), mask.cpu()])[None, :]
    if bf16:
        keys, vals = keys.bfloat16().double(), vals.bfloat16().double()
    s = (q.cpu().double().transpose(0, 1) @ keys.transpose(1, 2) * sm_scale).masked_fill(
        ~seen, -math.inf
    )
    p = s.softmax(-1)
    if bf16:
        p = p.bfloat16().double()
    o = (p @ vals).transpose(0, 1)
    return o.bfloat16().double() if bf16 else o


def run_kernel(q, k, v, cache, batch, row, sm_scale, **kw):
    out = torch.full_like(q, math.nan)
    o = extend_attention(q, k, v, cache, batch, row, sm_scale, out=out, path="triton", **kw)
    assert o.data_ptr() == out.data_ptr()
    return o


def check(o, cache, batch, row, q, k, v, sm_scale, mask=None):
    assert torch.isfinite(o).all(), "unwritten or non-finite output"
    ref = reference(cache, batch, row, q, k, v, sm_scale, mask=mask)
    bar = reference(cache, batch, row, q, k, v, sm_scale, bf16=True, mask=mask)
    rows = slice(None) if mask is None else mask.cpu()
    err = rel_l2(o.cpu()[rows], ref[rows])
    bar = rel_l2(bar[rows], ref[rows])
    assert err <= max(2 * bar, 1e-3), f"error {err:.2e} > 2 x bf16 attention {bar:.2e}"
    assert err <= 8e-3, f"error {err:.2e} > 8e-3"


W = dict(sink_tokens=4, recent_tokens=16)
# (K, V, windows, stored history, chunk, GQA ratio, splits): every K/V axis pair and both bit
# widths; chunks of 1, primes and non-multiples of the page (16) and group; histories empty,
# inside the windows and spanning pages; GQA 1 to 8; one and several history splits. A grid
# reduced from the cross product (the interpreter takes seconds per case): each axis pair meets
# windows and none, long and short histories, and a split count above one.
CASES = [
    ((2, "token", 32), (4, "token", 32), W, 263, 17, 4, 1),
    ((2, "token", 32), (2, "token", 64), {}, 113, 1, 1, 3),
    ((4, "token", 64), (2, "token", 32), W, 11, 37, 3, 1),
    ((2, "channel", 32), (4, "token", 32), W, 263, 5, 8, 2),
    ((4, "channel", 128), (2, "token", 32), {}, 263, 17, 2, 1),
    ((2, "channel", 32), (2, "token", 64), W, 1, 13, 5, 1),
    ((2, "token", 32), (2, "channel", 32), W, 199, 23, 4, 3),
    ((4, "token", 32), (4, "channel", 64), {}, 130, 1, 7, 1),
    ((2, "token", 64), (2, "channel", 128), W, 19, 9, 1, 1),
    ((2, "channel", 32), (2, "channel", 32), W, 263, 17, 4, 2),
    ((4, "channel", 64), (4, "channel", 32), {}, 97, 3, 6, 1),
    ((2, "channel", 64), (2, "channel", 64), W, 3, 29, 2, 1),
]


def case_id(c):
    k, v, w, hist, t, ratio, splits = c
    win = "w" if w else "nw"
    return f"K{k[0]}{k[1][0]}{k[2]}-V{v[0]}{v[1][0]}{v[2]}-{win}-L{hist}-T{t}-G{ratio}-S{splits}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_extend_matches_fp64_reference(case):
    kf, vf, windows, history, t, ratio, splits = case
    fmt = KVFormat(QuantFormat(*kf), QuantFormat(*vf), **windows)
    cache, batch = make_cache(fmt, history, seed=history + t)
    q, k, v = chunk(t, ratio)
    o = run_kernel(q, k, v, cache, batch, 0, 0.2, num_splits=splits)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    check(o, cache, batch, 0, q, k, v, 0.2)


def test_second_row_and_small_blocks():
    """The request is the plan's second row, chunk tokens per program 1 (16 padded query
    columns at GQA 2) and 32-token history tiles: rows, padding columns and tile sizes."""
    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(4, "channel", 32), **W)
    cache, batch = make_cache(fmt, 41, other=150)
    q, k, v = chunk(11, 2, dtype=torch.float32)
    cfg = ExtendConfig(block_t=1, block_n=32)
    o = run_kernel(q, k, v, cache, batch, 1, 0.2, config=cfg, num_splits=2)
    assert o.dtype == torch.float32
    check(o, cache, batch, 1, q, k, v, 0.2)


def test_query_aligned_with_its_own_key_returns_its_value():
    """Bit-exact reading of the chunk: each query a large multiple of its own token's key
    (margin of hundreds in the logits) puts all the probability on that key, so the output is
    the token's value row exactly, for every query head of the KV head."""
    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "token", 32), **W)
    cache, batch = make_cache(fmt, 40)
    _, k, v = chunk(3, 3)
    q = (k.float() * 50).repeat_interleave(3, dim=1).to(torch.bfloat16)
    o = run_kernel(q, k, v, cache, batch, 0, 0.2)
    torch.testing.assert_close(o, v.repeat_interleave(3, dim=1), rtol=0, atol=0)


def test_oscar_rotations_applied_on_query_and_output():
    """A layer storing ``k R_K`` and ``v R_V``: the kernel rotates the query, the chunk and the
    output, and matches the reference in the model's coordinates."""
    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(4, "token", 32), **W)
    cache, batch = make_cache(fmt, 150, rotate=True)
    q, k, v = chunk(7, 2)
    o = run_kernel(q, k, v, cache, batch, 0, 0.2)
    check(o, cache, batch, 0, q, k, v, 0.2)


def test_new_mask_drops_padding_tokens():
    """Padding tokens of the chunk (``new_mask`` False) are no keys; the real rows match the
    reference that masks them, and the padding rows are zero."""
    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "channel", 32), **W)
    cache, batch = make_cache(fmt, 70)
    q, k, v = chunk(9, 2)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool, device=KERNEL_DEVICE)
    o = run_kernel(q, k, v, cache, batch, 0, 0.2, new_mask=mask)
    check(o, cache, batch, 0, q, k, v, 0.2, mask=mask)
    assert (o[~mask] == 0).all()


def test_torch_path_matches_kernel_path():
    """The CPU's torch path (history dequantized, then SDPA) and the kernel agree."""
    fmt = KVFormat(QuantFormat(4, "channel", 32), QuantFormat(4, "token", 32), **W)
    cache, batch = make_cache(fmt, 90)
    q, k, v = chunk(6, 4)
    o_kernel = run_kernel(q, k, v, cache, batch, 0, 0.2)
    o_torch = extend_attention(q, k, v, cache, batch, 0, 0.2, path="torch")
    assert rel_l2(o_kernel, o_torch) < 1e-2


def test_bad_arguments_raise_before_work():
    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "token", 32))
    cache, batch = make_cache(fmt, 20)
    q, k, v = chunk(3, 2)
    with pytest.raises(ValueError, match="k_chunk"):
        extend_attention(q, k[:2], v, cache, batch, 0)
    with pytest.raises(ValueError, match="q_chunk"):
        extend_attention(q[..., :32], k, v, cache, batch, 0)
    with pytest.raises(ValueError, match="row"):
        extend_attention(q, k, v, cache, batch, 2)
    with pytest.raises(ValueError, match="new_mask"):
        extend_attention(q, k, v, cache, batch, 0, new_mask=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="path"):
        extend_attention(q, k, v, cache, batch, 0, path="cuda")


def test_split_count_fills_the_device():
    cfg = ExtendConfig(block_t=8, block_n=64)
    assert extend_splits(8192, 8, 32768, cfg, 132) == 1  # 8192 programs: no split
    assert extend_splits(1, 8, 32768, cfg, 132) == 17  # 8 programs: 17 splits fill 132 SMs
    assert extend_splits(1, 8, 64, cfg, 132) == 1  # one tile: nothing to split


@pytest.mark.gpu(reason="too slow in the interpreter")
@pytest.mark.parametrize("t,history", [(512, 4096), (2048, 8191)])
def test_long_chunk_on_long_history_gpu(t, history):
    fmt = KVFormat(QuantFormat(2, "channel", 64), QuantFormat(2, "token", 64), **W)
    cache, batch = make_cache(fmt, history)
    q, k, v = chunk(t, 4)
    o = run_kernel(q, k, v, cache, batch, 0, 0.125)
    check(o, cache, batch, 0, q, k, v, 0.125)


def _extend_sass(*args) -> str:
    """benchmarks/tools/extend_sass.py's output for ``args``, which must succeed (in a
    subprocess: the tests run with TRITON_INTERPRET=1); skips without ptxas."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run(
        [sys.executable, "benchmarks/tools/extend_sass.py", *args],
        capture_output=True, text=True, cwd=root, env=dict(os.environ, TRITON_INTERPRET="0"),
    )  # fmt: skip
    if "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip(f"no ptxas here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


@pytest.mark.parametrize("fmt_name", ["int2", "kivi2"])
def test_kernel_compiles_for_sm90(fmt_name):
    """The compiled path (not the interpreter's) builds for sm_90a with the default config."""
    assert "regs=" in _extend_sass("--default-only", "--formats", fmt_name)


def test_token_wise_key_fold_compiles_without_fp32_dot():
    """Token-wise K in two channel groups at head_dim 64, 32 query columns: the offset term
    compiles to fp32 FMAs, not the TF32 dot of K = 2 in which the kernel faulted on an H100
    (Note [no fp32 dot] in foscar/kernels/triton_decode.py), in seconds and 32-token tiles."""
    out = _extend_sass("--every-format", "-k", "Kt32-Vt32", "--head-dim", "64", "--ratio", "1")
    assert "fp32_dots=0" in out and "block_n=32" in out, out


# ---------------------------------------------------------------------------- the call sites
def kernel_everywhere(monkeypatch):
    """Route the attention core's extend_attention (both call sites: FoscarCache and the serving
    core) to the kernel (on the CPU: the interpreter), as a GPU does, to check what they hand it
    (layouts, rows, masks)."""
    import functools

    from foscar import attention

    monkeypatch.setattr(
        attention, "extend_attention", functools.partial(extend_attention, path="triton")
    )


#: the call-site tests hand the kernel CPU tensors, as the engine and FoscarCache do on a CPU:
#: they need the interpreter (a CUDA machine runs the kernel cases above on the GPU instead)
needs_interpreter = pytest.mark.skipif(
    not triton_runtime.interpreting(), reason="routes CPU tensors to the kernel: the interpreter"
)


@needs_interpreter
def test_serving_core_chunk_on_the_kernel_matches_torch_path(monkeypatch):
    """PagedKV: a chunk row (13 tokens on 40 stored, beside a decode row) attends through the
    kernel as through the torch path."""
    from foscar.serving import PagedKV, StepRow

    fmt = KVFormat(QuantFormat(4, "token", 64), QuantFormat(2, "channel", 32), **W)

    def run():
        kv = PagedKV(fmt, num_layers=2, num_kv_heads=2, head_dim=HEAD_DIM, num_blocks=16,
                     block_size=PAGE, max_requests=3)  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        steps = [
            [StepRow("a", 0, 40), StepRow("b", 0, 21)],
            [StepRow("b", 21, 1), StepRow("a", 40, 13)],
        ]
        outs = []
        for rows in steps:
            kv.begin_step(rows)
            t = sum(r.query_length for r in rows)
            q = torch.randn(t, 6, HEAD_DIM, generator=gen).bfloat16().float()
            k, v = (torch.randn(t, 2, HEAD_DIM, generator=gen).bfloat16().float() for _ in "kv")
            outs.append([kv.attend(layer, q, k, v, scaling=0.125) for layer in range(2)])
        return outs[-1]

    torch_path = run()
    kernel_everywhere(monkeypatch)
    kernel = run()
    for a, b in zip(kernel, torch_path):
        assert torch.isfinite(a).all()
        assert rel_l2(a, b) < 1e-2


@needs_interpreter
def test_foscar_cache_chunked_prefill_on_the_kernel_matches_torch_path(monkeypatch):
    """FoscarCache's extend path (a tiny Llama, two rows, the second left-padded, the prompt
    in chunks of 19 and 11) gives the logits of the torch path through the kernel."""
    from conftest import tiny_llama

    from foscar.integrations.transformers import FoscarCache, cache_kwarg, use_foscar_attention

    model = tiny_llama(layers=2, q_heads=4, kv_heads=2, head_dim=HEAD_DIM)
    use_foscar_attention(model)
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(4, "token", 64), **W)
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :3] = 0  # left padding of the second row

    @torch.no_grad()
    def logits():
        cache = FoscarCache(fmt, model.config, max_cache_len=32, page_size=PAGE)
        kw = {cache_kwarg(model): cache}
        outs = []
        for a, b in ((0, 19), (19, 30)):
            out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], use_cache=True, **kw)
            outs.append(out.logits)
        return outs[-1]

    torch_path = logits()
    kernel_everywhere(monkeypatch)
    kernel = logits()
    assert torch.isfinite(kernel).all()
    assert rel_l2(kernel, torch_path) < 1e-2
