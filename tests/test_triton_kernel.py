"""The Triton decode kernel against the fp64 reference over the dequantized cache.

On a CPU machine every test here runs the real kernel code through the Triton interpreter
(conftest sets TRITON_INTERPRET=1; the kernel's INTERP path computes with fp32 operands that
hold exactly the bf16 operand values). On a GPU the same tests run compiled, plus the paper's
shapes, random ragged batches and CUDA graphs, which are too slow for the interpreter.
"""

import itertools
import math

import pytest
import torch
from conftest import KERNEL_DEVICE
from kernel_cases import build_cache, check_against_reference, queries, rel_l2

from foscar import KVFormat, QuantFormat, decode_attention
from foscar.reference import dequantize_sequence

pytest.importorskip("triton")

gpu_only = pytest.mark.gpu(reason="too slow in the interpreter")

# lengths 1 and primes: single-token, partial-tile, multi-tile and multi-page sequences
LENGTHS = (1, 17, 113, 263)


def run(q, cache, batch, backend="triton", **kw):
    """Decode into NaN-poisoned outputs, so that any unwritten element fails the check."""
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device)
    o, lse = decode_attention(
        q, cache, batch, backend=backend, return_lse=True, out=out, lse=lse, **kw
    )
    assert o.data_ptr() == out.data_ptr()
    return o, lse


AXES = list(itertools.product(["token", "channel"], repeat=2))
BITS = list(itertools.product([2, 4], repeat=2))
EVERY_FORMAT = [(kb, vb, ka, va) for (kb, vb), (ka, va) in itertools.product(BITS, AXES)]


def _every_format_params():
    for kb, vb, ka, va in EVERY_FORMAT:
        yield pytest.param(kb, vb, ka, va, id=f"K{kb}{ka}-V{vb}{va}")


@pytest.mark.parametrize("kb,vb,ka,va", list(_every_format_params()))
def test_every_format_combination(kb, vb, ka, va):
    index = EVERY_FORMAT.index((kb, vb, ka, va))
    gk, gv = (128, 64, 32)[index % 3], (64, 32, 128)[index % 3]
    fmt = KVFormat(QuantFormat(kb, ka, gk), QuantFormat(vb, va, gv))
    cache, batch = build_cache(fmt, LENGTHS, device=KERNEL_DEVICE, seed=index)
    q = queries(batch, 8, 128, KERNEL_DEVICE)
    o, lse = run(q, cache, batch)
    check_against_reference(o, lse, q, cache, batch)


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_group_sizes(axis, group):
    fmt = KVFormat(QuantFormat(2, axis, group), QuantFormat(4, axis, group))
    cache, batch = build_cache(fmt, (5, 200), device=KERNEL_DEVICE, seed=group)
    q = queries(batch, 8, 128, KERNEL_DEVICE)
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 5, 8, 16])
def test_gqa_ratios(ratio):
    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "channel", 64))
    cache, batch = build_cache(fmt, (3, 130), device=KERNEL_DEVICE, seed=ratio)
    q = queries(batch, 2 * ratio, 128, KERNEL_DEVICE)
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_token_wise_key_groups_at_16_query_heads(head_dim):
    """Token-wise K in several channel groups per row folded over 16 query columns, the most
    the kernel takes (the extend kernel's tiles hold 16 or 32; the other tests reach 8 columns
    with several groups)."""
    ratio = 16
    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(4, "token", 32), recent_tokens=5)
    cache, batch = build_cache(fmt, (1, 113, 263), head_dim=head_dim, device=KERNEL_DEVICE)
    q = queries(batch, 2 * ratio, head_dim, KERNEL_DEVICE)
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@pytest.mark.parametrize("ka,va", AXES)
def test_head_dim_64(ka, va):
    fmt = KVFormat(QuantFormat(2, ka, 64), QuantFormat(4, va, 32))
    cache, batch = build_cache(fmt, LENGTHS, head_dim=64, device=KERNEL_DEVICE)
    q = queries(batch, 6, 64, KERNEL_DEVICE)
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_page_sizes(page_size):
    fmt = KVFormat(QuantFormat(2, "channel", 32), QuantFormat(2, "token", 64))
    cache, batch = build_cache(fmt, (1, 300), page_size=page_size, device=KERNEL_DEVICE)
    q = queries(batch, 8, 128, KERNEL_DEVICE)
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@pytest.mark.parametrize("sink,recent", [(4, 0), (0, 37), (5, 70), (128, 512)])
def test_bf16_windows(sink, recent):
    fmt = KVFormat(
        QuantFormat(2, "token", 128, clip=0.96),
        QuantFormat(2, "channel", 32),
        sink_tokens=sink,
        recent_tokens=recent,
    )
    cache, batch = build_cache(fmt, (2, 90, 800), device=KERNEL_DEVICE)
    q = queries(batch, 8, 128, KERNEL_DEVICE)
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_split_counts_and_poisoned_workspace(splits):
    fmt = KVFormat(QuantFormat(4, "token", 64), QuantFormat(2, "token", 128), recent_tokens=3)
    cache, batch = build_cache(fmt, (1, 700), device=KERNEL_DEVICE)
    q = queries(batch, 8, 128, KERNEL_DEVICE)
    from foscar.backends import triton as tb

    plan = tb.TritonDecodePlan(cache, batch, 8, 1 / math.sqrt(128), splits=splits)
    assert plan.workspace.tensors()  # allocated when the plan is made
    for o_part, lse_part in plan.workspace.tensors():
        o_part.fill_(math.nan)
        lse_part.fill_(math.nan)
    o, lse = plan.run(q, return_lse=True)
    check_against_reference(o, lse, q, cache, batch)


@pytest.mark.parametrize("block_n,splits", [(32, 3), (64, 1), (64, 5), (128, 2)])
@pytest.mark.parametrize("va", ["token", "channel"])
def test_channel_key_fold_once_per_group(block_n, splits, va):
    """Channel-wise K groups longer than a tile are folded into Q once per group and split
    on group boundaries (4, 2 and 1 tiles per group; more splits than groups included)."""
    from foscar.backends import triton as tb
    from foscar.configs import TritonDecodeConfig

    fmt = KVFormat(QuantFormat(2, "channel", 128), QuantFormat(4, va, 64), recent_tokens=5)
    cache, batch = build_cache(fmt, (3, 300, 700), device=KERNEL_DEVICE, seed=block_n)
    q = queries(batch, 8, 128, KERNEL_DEVICE)
    cfg = TritonDecodeConfig(block_n=block_n)
    o, lse = tb.decode(
        q, cache, batch, 1 / math.sqrt(128), config=cfg, splits=splits, return_lse=True
    )
    check_against_reference(o, lse, q, cache, batch)


def test_one_token_returns_its_value_row():
    """With one cached token, every head's output is that token's dequantized V row."""
    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 32))
    cache, batch = build_cache(fmt, (1, 1), decode_steps=0, device=KERNEL_DEVICE)
    q = queries(batch, 8, 128, KERNEL_DEVICE)
    o, _ = run(q, cache, batch)
    for i in range(2):
        _, v = dequantize_sequence(cache, batch, i, torch.float64)  # [H, 1, D]
        expected = v[:, 0].repeat_interleave(4, dim=0)  # [Hq, D]
        assert rel_l2(o[i], expected) < 2**-8


@pytest.mark.parametrize("ka,va", AXES)
def test_reconstruct_backend(ka, va):
    fmt = KVFormat(QuantFormat(2, ka, 128), QuantFormat(4, va, 64), sink_tokens=2)
    cache, batch = build_cache(fmt, LENGTHS, device=KERNEL_DEVICE)
    q = queries(batch, 8, 128, KERNEL_DEVICE)
    check_against_reference(*run(q, cache, batch, backend="triton-reconstruct"), q, cache, batch)


def test_kernel_rejections():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), mapping="e4m3")
    cache, batch = build_cache(fmt, (10,), head_dim=64, device=KERNEL_DEVICE)
    q = queries(batch, 4, 64, KERNEL_DEVICE)
    with pytest.raises(ValueError, match="mapping is 'e4m3'"):
        decode_attention(q, cache, batch, backend="triton")
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache, batch = build_cache(fmt, (10,), head_dim=64, device=KERNEL_DEVICE)
    with pytest.raises(TypeError, match="needs bfloat16 queries"):
        decode_attention(q.float(), cache, batch, backend="triton")
    with pytest.raises(ValueError, match="at most 16 query heads per KV head"):
        decode_attention(queries(batch, 34, 64, KERNEL_DEVICE), cache, batch, backend="triton")


# ---------------------------------------------------------------------------- GPU only
PAPER_FORMATS = [(bits, ka, va) for bits in (2, 4) for ka, va in AXES]


@gpu_only
@pytest.mark.parametrize("bits,ka,va", PAPER_FORMATS)
def test_paper_shape(bits, ka, va):
    """H_Q=32, H_KV=8, D=128, page 64, g=128, 32K tokens, zero-mean data."""
    fmt = KVFormat(QuantFormat(bits, ka, 128), QuantFormat(bits, va, 128))
    cache, batch = build_cache(fmt, (32768, 4099), num_kv_heads=8, device="cuda", seed=bits)
    q = queries(batch, 32, 128, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@gpu_only
@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20000, (16,), generator=g).tolist()
    bits = [(2, 2), (4, 4), (2, 4), (4, 2)][seed]
    axes = AXES[seed]
    fmt = KVFormat(
        QuantFormat(bits[0], axes[0], 128),
        QuantFormat(bits[1], axes[1], 64),
        sink_tokens=64 * (seed % 2),
        recent_tokens=256 * (seed % 2),
    )
    cache, batch = build_cache(fmt, lengths, num_kv_heads=8, device="cuda", seed=seed)
    q = queries(batch, 32, 128, "cuda")
    check_against_reference(*run(q, cache, batch), q, cache, batch)


@gpu_only
@pytest.mark.parametrize("ka,va", AXES)
def test_cuda_graph_replay(ka, va):
    """Capture once, replay with new queries: no host sync, no allocation in the hot path."""
    fmt = KVFormat(
        QuantFormat(2, ka, 128), QuantFormat(2, va, 128), sink_tokens=16, recent_tokens=64
    )
    cache, batch = build_cache(fmt, (3000, 17, 9000), num_kv_heads=8, device="cuda")
    q = queries(batch, 32, 128, "cuda")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    decode_attention(q, cache, batch, out=out, lse=lse, return_lse=True)  # compile, workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, cache, batch, out=out, lse=lse, return_lse=True)
    for seed in range(3):
        q.copy_(queries(batch, 32, 128, "cuda", seed=10 + seed))
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(out, lse, q, cache, batch)
