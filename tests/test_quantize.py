"""Quantizer round trip (error source (a)): min-max and clipped, both axes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foscar.formats import QuantFormat
from foscar.quantize import clip_per_token, dequantize, quantize


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_min_max_round_trip_within_half_step(bits, axis, group_size):
    fmt = QuantFormat(bits, axis, group_size)
    x = torch.randn(3, 256, 128) * torch.linspace(0.1, 10, 128)
    codes, s, z = quantize(x, fmt)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= fmt.levels
    if axis == "token":
        assert s.shape == (3, 256, 128 // group_size)
    else:
        assert s.shape == (3, 256 // group_size, 128)
    xh = dequantize(codes, s, z, fmt, dtype=torch.float64)
    half_step = dequantize(torch.ones_like(codes), s, torch.zeros_like(z), fmt, torch.float64) / 2
    assert torch.all((xh - x.double()).abs() <= half_step * (1 + 1e-5) + 1e-6)
    # min-max uses the whole range: every group has its min at code 0 and its max at the top
    groups = (
        codes.reshape(3, 256, 128 // group_size, group_size)
        if axis == "token"
        else (codes.reshape(3, 256 // group_size, group_size, 128).transpose(-1, -2))
    )
    assert torch.all(groups.amin(-1) == 0) and torch.all(groups.amax(-1) == fmt.levels)


def test_constant_group_is_exact_and_finite():
    fmt = QuantFormat(2, "token", 32)
    x = torch.full((4, 64), 0.75)
    codes, s, z = quantize(x, fmt)
    assert torch.all(torch.isfinite(s)) and torch.all(s > 0)
    assert torch.allclose(dequantize(codes, s, z, fmt), x)


@settings(max_examples=40, deadline=None)
@given(p=st.floats(0.5, 1.0), d=st.sampled_from([64, 128]), seed=st.integers(0, 2**31))
def test_clip_per_token_counts(p, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, d, generator=g, dtype=torch.float64)
    y = clip_per_token(x, p)
    index = min(int(p * d), d - 1)
    tau = x.abs().sort(dim=-1).values[:, index]
    assert torch.all(y.abs() <= tau[:, None])
    # exactly d - 1 - index values of each row exceed tau and are clipped (continuous data)
    changed = (y != x).sum(-1)
    assert torch.all(changed == d - 1 - index)


def test_oscar_clip_ratios_clip_5_and_10_of_128():
    x = torch.randn(8, 128, dtype=torch.float64)
    assert torch.all((clip_per_token(x, 0.96) != x).sum(-1) == 5)
    assert torch.all((clip_per_token(x, 0.92) != x).sum(-1) == 10)


def test_clipped_quantizer_applies_the_clip_first():
    fmt = QuantFormat(2, "token", 128, clip=0.96)
    x = torch.randn(32, 128)
    x[:, 7] = 50.0  # an outlier channel
    codes, s, z = quantize(x, fmt)
    ref_codes, ref_s, ref_z = quantize(clip_per_token(x, 0.96), QuantFormat(2, "token", 128))
    assert torch.equal(codes, ref_codes) and torch.equal(s, ref_s) and torch.equal(z, ref_z)
    # the clip shrinks the step a lot compared with min-max over the outlier
    _, s_minmax, _ = quantize(x, QuantFormat(2, "token", 128))
    assert torch.all(s < s_minmax / 5)


def test_channel_wise_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32 tokens"):
        quantize(torch.randn(40, 64), QuantFormat(2, "channel", 32))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_a_gpu_quantizes_to_the_cpus_bits(bits, axis):
    """IEEE division on both devices (CUDA torch multiplies by the reciprocal of a Python
    divisor), so a cache quantizes to the same bits wherever it lives."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(4, 256, 128, generator=g) * torch.rand(1, 1, 128, generator=g) * 5
    fmt = QuantFormat(bits, axis, 32)
    for a, b in zip(quantize(x, fmt), quantize(x.cuda(), fmt)):
        assert torch.equal(a, b.cpu())


def test_gptq_factor_is_the_upper_cholesky_of_the_damped_inverse():
    from foscar.quantize import gptq_factor

    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 16, 16, generator=g, dtype=torch.float64)
    h = a @ a.transpose(-1, -2)
    u = gptq_factor(h, damp=0.1)
    damped = h + 0.1 * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(16)
    torch.testing.assert_close(u.transpose(-1, -2) @ u, torch.linalg.inv(damped))
    assert torch.equal(u, u.triu()) and bool((torch.diagonal(u, dim1=-2, dim2=-1) > 0).all())


@pytest.mark.parametrize("clip", [None, 0.9])
def test_gptq_rounding(clip):
    """quantize_gptq keeps quantize's scale and offset; with a diagonal factor its codes are
    quantize's; with a correlated metric H it lowers e^T H e (here a rank-8 H of 64 channels:
    to a tenth of rounding to nearest)."""
    from foscar.quantize import gptq_factor, quantize_gptq

    g = torch.Generator().manual_seed(1)
    f = QuantFormat(2, "token", 64, clip)
    x = torch.randn(3, 257, 64, generator=g)
    codes, scale, offset = quantize(x, f)
    diag = torch.diag_embed(torch.rand(3, 64, generator=g) + 0.5)
    c2, s2, z2 = quantize_gptq(x, f, diag)
    assert torch.equal(c2, codes) and torch.equal(s2, scale) and torch.equal(z2, offset)
    a = torch.randn(3, 64, 8, generator=g, dtype=torch.float64)
    h = a @ a.transpose(-1, -2) + 0.01 * torch.eye(64, dtype=torch.float64)
    c3, s3, z3 = quantize_gptq(x, f, gptq_factor(h))
    assert torch.equal(s3, scale) and torch.equal(z3, offset)
    assert int(c3.max()) <= 3 and c3.dtype == torch.uint8

    def metric(c):
        e = (x - dequantize(c, scale, offset, f)).double()
        return float(torch.einsum("htd,hde,hte->", e, h, e))

    assert metric(c3) < 0.2 * metric(codes)


def _gptq_codes_row_major(x, f, factor):
    """GPTQ's codes written as the algorithm reads: channel after channel of each [H, T, D]
    row, each rounding error fed forward (the textbook form quantize_gptq reorders)."""
    _, scale, lo = quantize(x, f)
    g = f.group_size
    s, z = scale.repeat_interleave(g, dim=-1), lo.repeat_interleave(g, dim=-1)
    w = x.to(torch.float32).clone()
    codes = torch.empty_like(w)
    for j in range(w.shape[-1]):
        q = torch.floor((w[..., j] - z[..., j]) / s[..., j] + 0.5).clamp_(0, f.levels)
        codes[..., j] = q
        err = (w[..., j] - (q * s[..., j] + z[..., j])) / factor[:, j, j][:, None]
        w[..., j + 1 :] -= err[..., None] * factor[:, None, j, j + 1 :]
    return codes.to(torch.uint8)


@pytest.mark.parametrize("shape,group", [((3, 257, 64), 64), ((8, 17, 128), 32), ((1, 1, 32), 32)])
@pytest.mark.parametrize("clip", [None, 0.92])
def test_gptq_codes_equal_the_channel_by_channel_algorithm(shape, group, clip):
    """quantize_gptq's channel-major loop gives the textbook loop's codes bit for bit (bf16
    input as the cache writes it, several groups per row, one token), contiguous [H, T, D]."""
    from foscar.quantize import gptq_factor, quantize_gptq

    g = torch.Generator().manual_seed(2)
    h, _, d = shape
    x = (torch.randn(shape, generator=g) * (torch.rand(d, generator=g) * 4)).to(torch.bfloat16)
    a = torch.randn(h, d, d, generator=g, dtype=torch.float64)
    factor = gptq_factor(a @ a.transpose(-1, -2)).float()
    f = QuantFormat(2, "token", group, clip)
    codes, scale, offset = quantize_gptq(x, f, factor)
    assert codes.is_contiguous() and codes.shape == shape and codes.dtype == torch.uint8
    assert torch.equal(codes, _gptq_codes_row_major(x, f, factor))
    _, s_ref, z_ref = quantize(x, f)
    assert torch.equal(scale, s_ref) and torch.equal(offset, z_ref)


def test_gptq_rounding_rejects_what_it_does_not_cover():
    from foscar.quantize import quantize_gptq

    x = torch.randn(2, 64, 32)
    with pytest.raises(ValueError, match="token-wise groups"):
        quantize_gptq(x, QuantFormat(2, "channel", 64), torch.eye(32).expand(2, 32, 32))
    with pytest.raises(ValueError, match=r"factor must be \[heads=2, D, D\]"):
        quantize_gptq(x, QuantFormat(2, "token", 32), torch.eye(32))
