"""The E4M3 operand path (backend "gluon-e4m3") on adversarial inputs against fp64 attention
over the dequantized cache, within a bound derived from E4M3's unit roundoff
(kernel_cases.e4m3_error_bound). On the CPU: the torch emulation of the kernel's arithmetic
(foscar.kernels.e4m3_emulation), and the earlier arithmetic beyond the bound (so the bound
can fail); on a Hopper GPU: the kernel itself over the same caches and queries."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import (
    E4M3_ADVERSARIAL,
    e4m3_adversarial_cache,
    e4m3_emulated_attention,
    e4m3_error_bound,
    rel_l2,
)

from foscar import decode_attention
from foscar.kernels.e4m3_emulation import e4m3, emulate_head, stage_q
from foscar.reference import attend_dequantized

SM_SCALE = 1 / math.sqrt(128)
KINDS = sorted(E4M3_ADVERSARIAL)
#: (bits, V clipped, BF16 windows): the formats the path covers, clipped and min-max
FORMATS = [(4, True, False), (4, False, False), (2, True, False), (2, True, True)]


def _check(o, q, cache, batch):
    assert torch.isfinite(o).all(), "unwritten or non-finite output"
    ref, _ = attend_dequantized(q.double().cpu(), cache, batch, SM_SCALE)
    err = rel_l2(o.cpu(), ref.cpu())
    bound = e4m3_error_bound(q, cache, batch, SM_SCALE)
    assert err <= bound, f"relative L2 error {err:.2e} > bound {bound:.2e}"
    return err, bound


# ------------------------------------------------------------------------------ CPU: emulation
def test_e4m3_rounding_saturates_and_rounds_to_nearest():
    x = torch.tensor([500.0, -1000.0, 1.0 + 2**-4, 1.0 + 3 * 2**-4, 2.0**-10, 2.0**-9])
    assert e4m3(x).tolist() == [448.0, -448.0, 1.0, 1.25, 0.0, 2.0**-9]


def test_q_two_terms_leave_a_2_to_the_minus_8_error():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 128, generator=g) * torch.logspace(-3, 1, 8)[:, None]
    q = q.bfloat16().float()
    one = (stage_q(q, two_terms=False) - q).abs()
    two = (stage_q(q, two_terms=True) - q).abs()
    amax = q.abs().amax(-1, keepdim=True)
    assert (one <= 2.0**-4 * q.abs() + 2.0**-17 * amax).all()
    assert (two <= 2.0**-8 * q.abs() + 2.0**-17 * amax).all()
    assert two.max() < one.max() / 8


def test_emulation_rejects_bad_arguments():
    k = (torch.zeros(3, 128), torch.ones(3), torch.zeros(3))
    q = torch.zeros(2, 128)
    with pytest.raises(ValueError, match="tile_tokens"):
        emulate_head(q, k, k, v_bits=2, sm_scale=1.0, tile_tokens=32)
    with pytest.raises(ValueError, match="v_bits"):
        emulate_head(q, k, k, v_bits=3, sm_scale=1.0)
    with pytest.raises(ValueError, match="num_splits"):
        emulate_head(q, k, k, v_bits=2, sm_scale=1.0, num_splits=0)


@pytest.mark.parametrize("bits,clip_v,windows", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_emulation_within_the_e4m3_bound(kind, bits, clip_v, windows):
    """The kernel's E4M3 arithmetic (emulated) on every adversarial input and format."""
    cache, batch, q = e4m3_adversarial_cache(kind, bits, clip_v=clip_v, windows=windows)
    _check(e4m3_emulated_attention(q, cache, batch, SM_SCALE), q, cache, batch)


@pytest.mark.parametrize("page_size,ratio,tile_tokens,splits", [(16, 1, 64, 3), (32, 4, 128, 2)])
def test_emulation_page_sizes_gqa_and_splits(page_size, ratio, tile_tokens, splits):
    """Pages of 16 and 32 tokens, GQA 1 and 4, packed heads' 128-token tiles, several splits."""
    cache, batch, q = e4m3_adversarial_cache(
        "peaky", 4, clip_v=True, page_size=page_size, ratio=ratio, length=1500
    )
    o = e4m3_emulated_attention(
        q, cache, batch, SM_SCALE, tile_tokens=tile_tokens, num_splits=splits
    )
    _check(o, q, cache, batch)


@pytest.mark.parametrize("kind,bits", [("keys 100x", 4), ("key offsets", 2)])
def test_earlier_arithmetic_exceeds_the_bound(kind, bits):
    """One E4M3 copy of Q: logits from large keys or rows far from zero-mean carry Q's 2^-4
    rounding beyond the bound (0.35 and 0.36 when written)."""
    cache, batch, q = e4m3_adversarial_cache(kind, bits, clip_v=True, windows=bits == 2)
    ref, _ = attend_dequantized(q.double(), cache, batch, SM_SCALE)
    o = e4m3_emulated_attention(q, cache, batch, SM_SCALE, q_two_terms=False)
    assert rel_l2(o, ref) > e4m3_error_bound(q, cache, batch, SM_SCALE)


# ------------------------------------------------------------------------------ GPU: the kernel
@pytest.mark.gpu(capability=(9, 0), reason="launches the Gluon kernel")
@pytest.mark.parametrize("page_size,ratio", [(64, 4), (16, 1), (64, 1), (16, 4)])
@pytest.mark.parametrize("bits,clip_v,windows", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_gluon_e4m3_within_the_e4m3_bound(kind, bits, clip_v, windows, page_size, ratio):
    """backend "gluon-e4m3" on every adversarial input, format, page size 16 / 64 and GQA 1 / 4
    (the 32K sink and the packed / 3-CTA configs: benchmarks/tools/e4m3_accuracy.py)."""
    cache, batch, q = e4m3_adversarial_cache(
        kind,
        bits,
        clip_v=clip_v,
        windows=windows,
        page_size=page_size,
        ratio=ratio,
        length=4099,
        device="cuda",
    )
    o = torch.full_like(q, math.nan)
    o = decode_attention(q, cache, batch, backend="gluon-e4m3", out=o)
    _check(o, q, cache, batch)
