"""OSCAR rotations inside the cache write and the decode path: attention is unchanged.

Keys are stored as ``k R_K``, values as ``v R_V`` (every segment), queries are rotated by ``R_K``
and outputs by ``R_V^T``; in float64 (float64 windows) the rotated and unrotated caches give the
same attention to 1e-10, and with a quantized history the decode equals attention over the
stored (rotated, quantized) values computed here independently.
"""

import math

import pytest
import torch

import foscar
from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.oscar.rotation import hadamard, rotation
from foscar.quantize import dequantize, quantize
from foscar.reference import attend_dequantized, attention, dequantize_sequence

f64 = torch.float64
H, HQ, D = 2, 6, 64


def random_orthogonal(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*shape, D, D, dtype=f64, generator=g))
    return q


def make(fmt, layers=1, window_dtype=f64):
    return QuantizedKVCache(
        fmt,
        num_kv_heads=H,
        head_dim=D,
        num_pages=32,
        max_seqs=2,
        num_layers=layers,
        page_size=16,
        window_dtype=window_dtype,
    )


def fill(cache, k, v, layer=0, prefill=40):
    """Prefill ``prefill`` tokens of one sequence, then the rest one decode step at a time."""
    sid = cache.add_sequence() if not cache.sequences else cache.sequences[0]
    cache.append([sid], k[:prefill], v[:prefill], [prefill], layer=layer)
    for t in range(prefill, k.shape[0]):
        cache.append([sid], k[t : t + 1], v[t : t + 1], layer=layer)
    return sid


def tokens(n=53, seed=1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, dtype=f64, generator=g)
    v = torch.randn(n, H, D, dtype=f64, generator=g)
    q = torch.randn(1, HQ, D, dtype=f64, generator=g)
    return q, k, v


@pytest.mark.parametrize("per_head", [False, True])
def test_rotated_windows_leave_attention_unchanged_in_float64(per_head):
    """All tokens in float64 windows (sink + recent, crossing the ring): only rotations act."""
    fmt = KVFormat(
        QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), sink_tokens=5, recent_tokens=64
    )
    q, k, v = tokens()
    plain, rot = make(fmt), make(fmt)
    shape = (H,) if per_head else ()
    rot.set_transform(
        0, key_rotation=random_orthogonal(*shape, seed=2), value_rotation=random_orthogonal(*shape)
    )
    outs = []
    for cache in (plain, rot):
        sid = fill(cache, k, v)
        outs.append(foscar.decode_attention(q, cache, cache.plan([sid]), return_lse=True))
    (o0, lse0), (o1, lse1) = outs
    torch.testing.assert_close(o1, o0, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse1, lse0)  # fp32
    want, _ = attention(q[0].reshape(H, 3, D), k.transpose(0, 1), v.transpose(0, 1), 1 / 8)
    torch.testing.assert_close(o1[0], want.reshape(HQ, D), atol=1e-10, rtol=0)
    # what the windows hold is k R (rows), and dequantize_sequence undoes it
    batch = rot.plan([rot.sequences[0]])
    ks, vs = dequantize_sequence(rot, batch, 0, stored=True)
    rk = rot.transforms[0].key_rotation
    torch.testing.assert_close(ks, torch.einsum("thd,hde->hte", k, rk), atol=1e-12, rtol=0)
    km, vm = dequantize_sequence(rot, batch, 0)
    torch.testing.assert_close(km, k.transpose(0, 1), atol=1e-12, rtol=0)
    torch.testing.assert_close(vm, v.transpose(0, 1), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "fmt",
    [
        KVFormat(
            QuantFormat(2, "token", 32, 0.9),
            QuantFormat(2, "token", 64),
            sink_tokens=3,
            recent_tokens=5,
        ),
        KVFormat(QuantFormat(4, "channel", 32), QuantFormat(2, "token", 32, 0.92), recent_tokens=4),
    ],
    ids=lambda f: f.short(),
)
def test_quantized_history_is_attended_in_rotated_coordinates(fmt):
    q, k, v = tokens()
    cache = make(fmt, layers=2)
    rk, rv = random_orthogonal(H, seed=3), random_orthogonal(seed=4)
    cache.set_transform(1, key_rotation=rk, value_rotation=rv)
    sid = fill(cache, k, v, layer=1)
    batch = cache.plan([sid], layer=1)
    o, lse = foscar.decode_attention(q, cache, batch, return_lse=True)
    # independently: rotated query against the stored (rotated, quantized) K/V, then R_V^T
    ks, vs = dequantize_sequence(cache, batch, 0, stored=True)
    qr = torch.einsum("hgd,hde->hge", q[0].reshape(H, 3, D), rk)
    o_rot, lse_ref = attention(qr, ks, vs, 1 / math.sqrt(D))
    want = torch.einsum("hge,de->hgd", o_rot, rv).reshape(HQ, D)
    torch.testing.assert_close(o[0], want, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse[0], lse_ref.reshape(HQ).float())  # lse comes back in fp32
    # the reference over the dequantized cache works in the model's coordinates
    o_ref, _ = attend_dequantized(q, cache, batch)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    # the history holds the quantized rotated tokens (token-wise: quantized row by row)
    if fmt.key.axis.value == "token":
        s0, lq = fmt.sink_tokens, batch.num_quantized_host[0]
        kr = torch.einsum("thd,hde->hte", k, rk)[:, s0 : s0 + lq]
        codes, s, z = quantize(kr, fmt.key)
        torch.testing.assert_close(
            ks[:, s0 : s0 + lq], dequantize(codes, s, z, fmt.key, f64), atol=1e-4, rtol=0
        )


def test_out_argument_and_bf16_queries():
    fmt = KVFormat(
        QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), sink_tokens=2, recent_tokens=8
    )
    q, k, v = tokens()
    cache = make(fmt, window_dtype=torch.bfloat16)
    cache.set_transform(0, key_rotation=hadamard(D), value_rotation=random_orthogonal())
    sid = fill(cache, k, v)
    batch = cache.plan([sid])
    out = torch.full((1, HQ, D), float("nan"), dtype=torch.bfloat16)
    o = foscar.decode_attention(q.bfloat16(), cache, batch, out=out)
    assert o is out and out.dtype == torch.bfloat16
    o_ref, _ = attend_dequantized(q, cache, batch)
    torch.testing.assert_close(out.double(), o_ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="out must be"):
        foscar.decode_attention(q.bfloat16(), cache, batch, out=out[:, :3])


def _full_and_no_br_outputs(group_size):
    """Decode outputs of a cache rotated by U*H*P_br and by U*H (same targets), INT2 token-wise
    groups of ``group_size`` with a per-token clip."""
    from foscar.oscar.rotation import RECIPES

    fmt = KVFormat(*[QuantFormat(2, "token", group_size, 0.9)] * 2)
    q, k, v = tokens()
    c = torch.einsum("thd,the->de", k, k)
    outs = []
    for recipe in ("full", "no-br"):
        r = rotation(c, RECIPES[recipe])
        cache = make(fmt)
        cache.set_transform(0, key_rotation=r, value_rotation=r)
        sid = fill(cache, k, v)
        outs.append(foscar.decode_attention(q, cache, cache.plan([sid])))
    return outs


def test_bit_reversal_changes_nothing_when_a_group_spans_the_head():
    """P_br permutes channels inside the one group of a token: codes permute, outputs agree."""
    full, no_br = _full_and_no_br_outputs(D)
    torch.testing.assert_close(full, no_br, atol=1e-10, rtol=0)


def test_bit_reversal_acts_when_groups_split_the_head():
    """With two token-wise groups of 32 per 64-channel row, P_br decides which rotated
    directions share a scale: the codes, and so the outputs, differ from U*H's."""
    full, no_br = _full_and_no_br_outputs(32)
    assert (full - no_br).abs().max() > 1e-3


def test_layer_clip_replaces_the_formats():
    fmt = KVFormat(QuantFormat(2, "token", 64, 0.96), QuantFormat(2, "token", 64, 0.92))
    _, k, v = tokens()
    cache = make(fmt)
    cache.set_transform(0, key_clip=0.8, value_clip=1.0)
    sid = fill(cache, k, v)
    ks, vs = dequantize_sequence(cache, cache.plan([sid]), 0)
    for got, x, f in (
        (ks, k, QuantFormat(2, "token", 64, 0.8)),
        (vs, v, QuantFormat(2, "token", 64)),
    ):
        codes, s, z = quantize(x.transpose(0, 1), f)
        # to the fp32 rounding of the folded offset z' = z - 128 s'
        torch.testing.assert_close(got, dequantize(codes, s, z, f, f64), atol=1e-4, rtol=0)
    codes, s, z = quantize(k.transpose(0, 1), fmt.key)  # the format's clip: far off
    assert (ks - dequantize(codes, s, z, fmt.key, f64)).abs().max() > 0.1


def test_set_transform_rejects_bad_input():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = make(fmt, layers=2)
    with pytest.raises(ValueError, match="key_rotation must be orthogonal"):
        cache.set_transform(0, key_rotation=2 * torch.eye(D))
    with pytest.raises(ValueError, match=r"value_rotation must be \[head_dim=64"):
        cache.set_transform(0, value_rotation=torch.eye(32))
    with pytest.raises(TypeError, match="key_rotation must be a floating"):
        cache.set_transform(0, key_rotation=torch.eye(D, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_clip must be in \(0, 1\]"):
        cache.set_transform(0, key_clip=1.5)
    with pytest.raises(TypeError, match="value_clip must be None or a float"):
        cache.set_transform(0, value_clip="0.9")
    with pytest.raises(ValueError, match="layer must be in"):
        cache.set_transform(2, key_clip=0.9)
    _, k, v = tokens(5)
    fill(cache, k, v, layer=0, prefill=5)
    with pytest.raises(ValueError, match="layer 0 already stores tokens"):
        cache.set_transform(0, key_rotation=torch.eye(D))
    cache.set_transform(1, key_rotation=torch.eye(D))  # another layer is still empty
    assert cache.transforms[0].key_rotation is None  # rejected calls changed nothing


@torch.no_grad()
def test_gptq_keys_are_stored_as_quantize_gptq_rounds_them():
    """set_transform(key_gptq=...): every appended key (prefill and decode steps) is stored with
    quantize_gptq's codes for its KV head's factor, in the rotated basis; values and the
    stored scales are untouched (the fused decode write's equality with this path:
    tests/test_cache_write.py)."""
    from foscar.quantize import gptq_factor, quantize_gptq

    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    r = random_orthogonal(H)
    g = torch.Generator().manual_seed(3)
    a = torch.randn(H, D, 8, dtype=f64, generator=g)
    factor = gptq_factor(a @ a.transpose(-1, -2))
    _, k, v = tokens(53)
    plain, rounded = make(fmt), make(fmt)
    plain.set_transform(0, key_rotation=r)
    rounded.set_transform(0, key_rotation=r, key_gptq=factor)
    fill(plain, k, v)
    fill(rounded, k, v)
    batch = rounded.plan(rounded.sequences)
    got = dequantize_sequence(rounded, batch, 0, f64, stored=True)[0]
    # what GPTQ makes of the rotated keys, rounded to the window dtype as the cache does
    kr = torch.einsum("thd,hde->the", k, r).to(rounded.window_dtype)
    n = got.shape[1]
    codes, scale, offset = quantize_gptq(kr[:n].transpose(0, 1), fmt.key, factor.float())
    want = dequantize(codes, scale, offset, fmt.key, dtype=f64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = dequantize_sequence(plain, plain.plan(plain.sequences), 0, f64, stored=True)
    torch.testing.assert_close(base[1], dequantize_sequence(rounded, batch, 0, f64, stored=True)[1])
    assert not torch.allclose(base[0], got)


def test_set_transform_rejects_bad_gptq_factors():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = make(fmt)
    with pytest.raises(ValueError, match=r"key_gptq must be \[head_dim=64"):
        cache.set_transform(0, key_gptq=torch.eye(32))
    with pytest.raises(ValueError, match="upper triangular with a positive diagonal"):
        cache.set_transform(0, key_gptq=torch.ones(D, D))
    with pytest.raises(TypeError, match="key_gptq must be a floating"):
        cache.set_transform(0, key_gptq=torch.eye(D, dtype=torch.long))
    channel = make(KVFormat(QuantFormat(2, "channel", 64), QuantFormat(2, "token", 64)))
    with pytest.raises(ValueError, match="GPTQ rounding covers token-wise keys"):
        channel.set_transform(0, key_gptq=torch.eye(D))
    assert cache.transforms[0].key_gptq is None  # rejected calls changed nothing
    cache.set_transform(0, key_gptq=torch.eye(D))
    assert cache.transforms[0].key_gptq.shape == (H, D, D)


@pytest.mark.parametrize("heads, group", [(1, 1), (1, 4), (3, 1), (3, 4)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_rows_is_the_per_head_product(heads, group, inverse):
    """rotate_rows: row j of x times R_{j // group} (transposed with inverse), for leading
    batch axes, one rotation shared or one per KV head; float64 in, float64 out; narrower
    inputs in float32. LayerTransform.rotate converts a rotation to float32 once."""
    from foscar.cache import LayerTransform, rotate_rows

    g = torch.Generator().manual_seed(5)
    r = torch.linalg.qr(torch.randn(heads, D, D, dtype=f64, generator=g))[0]
    x = torch.randn(2, 5, heads * group, D, dtype=f64, generator=g)
    want = torch.stack(
        [
            x[..., j, :] @ (r[j // group].T if inverse else r[j // group])
            for j in range(x.shape[-2])
        ],
        dim=-2,
    )
    got = rotate_rows(x, r, inverse=inverse)
    assert got.dtype == f64 and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    x32 = x.to(torch.bfloat16)
    got32 = rotate_rows(x32, r, inverse=inverse)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, rotate_rows(x32.double(), r, inverse=inverse).float())
    tr = LayerTransform(key_rotation=r, value_rotation=r.flip(-1))
    assert torch.equal(tr.rotate(x32, "key", inverse=inverse), got32)
    first = tr.float32_rotation("key")
    assert first.dtype == torch.float32 and torch.equal(first, r.float())
    tr.rotate(x32, "key")
    assert tr.float32_rotation("key") is first  # converted once
    torch.testing.assert_close(tr.rotate(x, "value"), rotate_rows(x, r.flip(-1)), rtol=0, atol=0)


def test_rotate_rows_refuses_heads_that_do_not_divide():
    from foscar.cache import rotate_rows

    r = torch.eye(D, dtype=f64).expand(4, D, D)
    with pytest.raises(ValueError, match="x has 6 heads of 64 channels, r is \\[4, 64, 64\\]"):
        rotate_rows(torch.zeros(2, 6, D), r)
    with pytest.raises(ValueError, match="r is \\[4, 32, 32\\]"):
        rotate_rows(torch.zeros(2, 8, D), torch.eye(32).expand(4, 32, 32))
