"""A cache with one format per layer (``QuantizedKVCache(fmt=[...])``): the checks of
``foscar.layer_formats``, each layer's pools, the decode backends and the fused write per layer
against the reference, the accounting, and OSCAR's per-layer key and value widths
(``foscar.oscar.key_widths_by_error``, ``widths_by_error``, ``layer_width_formats``,
``apply_to_cache(clip_bits="cache")``).

The Triton kernels run through the interpreter on a CPU (conftest); the Gluon case needs a
Hopper GPU."""

import math

import pytest
import torch
from conftest import KERNEL_DEVICE
from kernel_cases import check_against_reference, queries

from foscar import (
    KVFormat,
    QuantFormat,
    QuantizedKVCache,
    decode_attention,
    effective_bits,
    layer_formats,
)
from foscar.backends import triton as triton_backend
from foscar.eval.harness import formats_short
from foscar.oscar import (
    OscarRotations,
    apply_to_cache,
    key_widths_by_error,
    layer_key_formats,
    layer_width_formats,
    layers_by_gain,
    oscar_cache,
    widths_by_error,
)
from foscar.reference import attend_dequantized

# lengths 1 and primes, non-multiples of the page (16) and of the groups
LENGTHS = (1, 17, 113, 263)


def _fmt(kb, vb, ka="token", va="token", gk=64, gv=64, sink=3, recent=5, mapping="bf16"):
    return KVFormat(QuantFormat(kb, ka, gk), QuantFormat(vb, va, gv), mapping, sink, recent)


#: widths, axes and groups differ by layer; the windows do not
MIXED = (
    _fmt(2, 2),
    _fmt(4, 2, gk=32),
    _fmt(2, 4, va="channel", gv=32),
    _fmt(4, 4, ka="channel", gk=128, va="channel", gv=32),
)
# channel-wise groups set the demotion quantum, which every layer must share: MIXED's last two
# layers have quantum 32/128, so they get their own cache below
TOKEN_WISE = (_fmt(2, 2), _fmt(4, 2, gk=32), _fmt(2, 4, gv=32), _fmt(4, 4))
CHANNEL = (_fmt(2, 4, va="channel", gv=32), _fmt(4, 2, ka="channel", gk=32))


def _cache(formats, head_dim=64, num_kv_heads=2, max_seqs=4, device="cpu", num_pages=160, **kw):
    return QuantizedKVCache(
        formats,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_pages=num_pages,
        max_seqs=max_seqs,
        num_layers=len(formats),
        page_size=16,
        device=device,
        **kw,
    )


def _fill(cache, lengths=LENGTHS, decode_steps=2, seed=0):
    """Prefill every layer with its own ragged K/V, then decode steps; returns the seq ids."""
    g = torch.Generator().manual_seed(seed)
    ids = [cache.add_sequence() for _ in lengths]
    h, d, dev = cache.num_kv_heads, cache.head_dim, cache.device
    for layer in range(cache.num_layers):
        n = sum(lengths)
        k, v = (torch.randn(n, h, d, generator=g) for _ in range(2))
        cache.append(ids, k.to(dev), v.to(dev), list(lengths), layer=layer)
    for _ in range(decode_steps):
        for layer in range(cache.num_layers):
            k, v = (torch.randn(len(ids), h, d, generator=g) for _ in range(2))
            cache.append(ids, k.to(dev), v.to(dev), layer=layer)
    return ids


# ---------------------------------------------------------------------------- the checks
def test_layer_formats_checks_name_the_entry_and_what_differs():
    f = _fmt(2, 2)
    assert layer_formats(f, 3) == (f, f, f)
    assert layer_formats([f, _fmt(4, 2)], 2) == (f, _fmt(4, 2))
    with pytest.raises(ValueError, match=r"holds 1 formats, expected one per layer \(num_lay"):
        layer_formats([f], 2)
    with pytest.raises(TypeError, match=r"fmt\[1\] must be a KVFormat, got QuantFormat"):
        layer_formats([f, QuantFormat()], 2)
    with pytest.raises(TypeError, match="fmt must be a KVFormat or a sequence"):
        layer_formats("bf16", 1)
    with pytest.raises(ValueError, match=r"fmt\[1\]\.recent_tokens is 6 but fmt\[0\]"):
        layer_formats([f, _fmt(2, 2, recent=6)], 2)
    with pytest.raises(ValueError, match=r"fmt\[1\]\.sink_tokens is 0"):
        layer_formats([f, _fmt(2, 2, sink=0)], 2)
    with pytest.raises(ValueError, match=r"fmt\[1\]\.mapping"):
        layer_formats([f, _fmt(2, 2, mapping="e4m3")], 2)
    with pytest.raises(ValueError, match=r"fmt\[1\]\.demotion_quantum is 32 but fmt\[0\]"):
        layer_formats([f, _fmt(2, 2, va="channel", gv=32)], 2)
    # the cache checks every entry against head_dim, naming the entry and the role
    with pytest.raises(ValueError, match=r"fmt\[1\]: head_dim \(64\) must be divisible by key"):
        _cache([f, _fmt(2, 2, gk=128)], head_dim=64)


def test_each_layer_gets_its_own_pools_and_fmt_refuses_to_answer_for_all():
    cache = _cache(TOKEN_WISE)
    assert cache.formats == TOKEN_WISE and cache.mixed_formats
    for layer, f in enumerate(TOKEN_WISE):
        st = cache.layers[layer]
        assert cache.layer_format(layer) == f
        assert st.k_words.shape[-1] == 64 * f.key.bits // 32
        assert st.v_words.shape[-1] == 64 * f.value.bits // 32
        assert st.k_scales.shape[2] == 16 * 64 // f.key.group_size
        assert st.v_scales.shape[2] == 16 * 64 // f.value.group_size
    with pytest.raises(ValueError, match=r"different formats .*layer_format\(layer\)"):
        _ = cache.fmt
    with pytest.raises(ValueError, match=r"layer must be in \[0, 4\)"):
        cache.layer_format(4)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 4\)"):
        cache.role_format(-1, "k")
    with pytest.raises(ValueError, match="name must be 'k' or 'v', got 'key'"):
        cache.role_format(0, "key")
    uniform = _cache([TOKEN_WISE[1]] * 2)
    assert not uniform.mixed_formats and uniform.fmt == TOKEN_WISE[1]


@pytest.mark.parametrize("formats", [TOKEN_WISE, CHANNEL], ids=["token", "channel"])
def test_each_layer_stores_what_a_cache_of_its_format_alone_stores(formats):
    """Layer ``i`` of the mixed cache holds, bit for bit, what a one-layer cache of format ``i``
    holds after the same appends (channel orders and packing tables are per width)."""
    mixed = _cache(formats)
    _fill(mixed)
    g = torch.Generator().manual_seed(0)
    h, d, n = 2, 64, sum(LENGTHS)
    data = []  # regenerate _fill's draws in its order: prefills of every layer, then steps
    for _ in formats:
        data.append([(torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g))])
    for _ in range(2):
        for layer in range(len(formats)):
            k, v = (torch.randn(len(LENGTHS), h, d, generator=g) for _ in range(2))
            data[layer].append((k, v))
    for layer, f in enumerate(formats):
        alone = _cache([f])
        ids = [alone.add_sequence() for _ in LENGTHS]
        (k, v), *steps = data[layer]
        alone.append(ids, k, v, list(LENGTHS))
        for k, v in steps:
            alone.append(ids, k, v)
        ours, theirs = mixed.layers[layer].tensors(), alone.layers[0].tensors()
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), (layer, name)


def test_accounting_sums_each_layers_format():
    cache = _cache(TOKEN_WISE)
    _fill(cache, lengths=(300,), decode_steps=0)
    stats = cache.memory_stats()
    assert stats["effective_bits"] == pytest.approx(effective_bits(300, TOKEN_WISE))
    # the mean over layers of each layer's own bits
    per_layer = [effective_bits(300, f) for f in TOKEN_WISE]
    assert effective_bits(300, TOKEN_WISE) == pytest.approx(sum(per_layer) / len(per_layer))
    assert effective_bits(300, [TOKEN_WISE[0]] * 3) == pytest.approx(
        effective_bits(300, TOKEN_WISE[0])
    )
    assert formats_short(TOKEN_WISE[:2] * 2) == (
        f"{TOKEN_WISE[0].short()} x2, {TOKEN_WISE[1].short()} x2"
    )
    assert formats_short((TOKEN_WISE[0],) * 2) == TOKEN_WISE[0].short()
    with pytest.raises(TypeError, match="non-empty sequence"):
        effective_bits(300, [])
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        layer_formats(TOKEN_WISE[0], 0)


# ---------------------------------------------------------------------------- decoding
def _backends():
    yield "reference"
    if triton_backend.available(torch.device(KERNEL_DEVICE)):
        yield "triton"


@pytest.mark.parametrize("backend", list(_backends()))
@pytest.mark.parametrize("formats", [TOKEN_WISE, CHANNEL], ids=["token", "channel"])
@pytest.mark.parametrize("ratio", [1, 3])
def test_decode_reads_each_layer_in_its_own_format(backend, formats, ratio):
    device = KERNEL_DEVICE if backend != "reference" else "cpu"
    cache = _cache(formats, device=device)
    ids = _fill(cache)
    for layer in range(cache.num_layers):
        batch = cache.plan(ids, layer)
        q = queries(batch, 2 * ratio, 64, device, seed=layer)
        out = torch.full_like(q, math.nan)
        lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=device)
        o, lse = decode_attention(
            q, cache, batch, backend=backend, return_lse=True, out=out, lse=lse
        )
        check_against_reference(o, lse, q, cache, batch)


@pytest.mark.gpu(capability=(9, 0), reason="launches the Gluon kernel")
def test_gluon_and_auto_read_each_layer_in_its_own_format():
    formats = tuple(
        KVFormat(QuantFormat(kb, "token", 128), QuantFormat(vb, "token", 128), "bf16", 4, 16)
        for kb, vb in ((2, 2), (4, 2), (2, 4), (4, 4))
    )
    cache = _cache(formats, head_dim=128, device="cuda", num_pages=300)
    ids = _fill(cache, lengths=(1, 17, 263, 4099))
    for layer in range(cache.num_layers):
        batch = cache.plan(ids, layer)
        q = queries(batch, 8, 128, "cuda", seed=layer)
        for backend in ("gluon", "auto"):
            out = torch.full_like(q, math.nan)
            o = decode_attention(q, cache, batch, backend=backend, out=out)
            check_against_reference(o, None, q, cache, batch)


@pytest.mark.skipif(
    not triton_backend.available(torch.device(KERNEL_DEVICE)), reason="Triton is not installed"
)
def test_fused_write_per_layer_equals_the_torch_write():
    """The fused decode write takes each layer's widths, groups and packing tables."""
    formats = (_fmt(2, 2, gk=32), _fmt(4, 2), _fmt(2, 4, gv=32), _fmt(4, 4, gk=32, gv=32))
    caches = [
        _cache(formats, device=KERNEL_DEVICE, max_seqs=2, decode_write=path)
        for path in ("torch", "fused")
    ]
    g = torch.Generator().manual_seed(3)
    for c in caches:
        c.add_sequence(), c.add_sequence()
    prompt = [(torch.randn(9, 2, 64, generator=g), torch.randn(9, 2, 64, generator=g))] * 4
    steps = [
        [(torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64, generator=g)) for _ in range(4)]
        for _ in range(6)  # crosses the 3 + 5 windows into the history
    ]
    for c in caches:
        for layer, (k, v) in enumerate(prompt):
            c.append([0, 1], k.to(c.device), v.to(c.device), [4, 5], layer=layer)
        for step in steps:
            for layer, (k, v) in enumerate(step):
                c.append([0, 1], k.to(c.device), v.to(c.device), layer=layer)
    for layer in range(len(formats)):
        torch_pools, fused_pools = (c.layers[layer].tensors() for c in caches)
        for name in torch_pools:
            a, b = torch_pools[name], fused_pools[name]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (layer, name)


# ---------------------------------------------------------------------------- OSCAR
def _rotations(int2_errors, int4_errors, layers=4, d=64, value_errors=None):
    eye = torch.eye(d, dtype=torch.float64).expand(layers, 1, d, d).clone()
    clips = {
        (2, "key"): torch.full((layers,), 0.85),
        (2, "value"): torch.full((layers,), 0.9),
        (4, "key"): torch.linspace(0.95, 1.0, layers),
        (4, "value"): torch.ones(layers),
    }
    fit = {
        "int2.key": {"fitted_relative_error": list(int2_errors)},
        "int4.key": {"fitted_relative_error": list(int4_errors)},
    }
    if value_errors is not None:  # (INT2 errors, INT4 errors) of the values
        for b, e in zip((2, 4), value_errors):
            fit[f"int{b}.value"] = {"fitted_relative_error": list(e)}
    return OscarRotations(eye, eye, clips, {"clip_fit": fit})


def test_key_widths_go_to_the_layers_that_gain_most():
    # squared gains: 0.08, 0.0899, 0.0, 0.08 (a tie with layer 0: the earlier layer wins)
    rot = _rotations([0.3, 0.3, 0.1, 0.3], [0.1, 0.01, 0.1, 0.1])
    assert key_widths_by_error(rot, 0) == [2, 2, 2, 2]
    assert key_widths_by_error(rot, 1) == [2, 4, 2, 2]
    assert key_widths_by_error(rot, 2) == [4, 4, 2, 2]
    assert key_widths_by_error(rot, 4) == [4, 4, 4, 4]
    with pytest.raises(ValueError, match=r"num_wide_layers must be in \[0, 4\], got 5"):
        key_widths_by_error(rot, 5)
    with pytest.raises(TypeError, match="num_wide_layers must be an int"):
        key_widths_by_error(rot, 1.0)
    bare = OscarRotations(rot.key, rot.value, rot.clips, {})
    with pytest.raises(ValueError, match="no INT2 key clip fit in the header"):
        key_widths_by_error(bare, 1)


def test_key_widths_of_rotations_chosen_per_layer_read_each_layers_candidate():
    """A choose_rotations header keeps every candidate's fit and the choice per layer: each
    layer's gain is its chosen candidate's."""
    a = _rotations([0.3, 0.3, 0.3], [0.0, 0.0, 0.0], layers=3)  # gains 0.09 everywhere
    b = _rotations([0.1, 0.5, 0.1], [0.1, 0.0, 0.1], layers=3)  # gains 0, 0.25, 0
    header = {
        "clip_fit": {"a": a.header["clip_fit"], "b": b.header["clip_fit"]},
        "selection": {"bits": 2, "key": ["b", "a", "a"], "value": ["a", "a", "a"]},
    }
    chosen = OscarRotations(a.key, a.value, a.clips, header)
    # chosen gains: layer 0 from b (0), layers 1-2 from a (0.09 each)
    assert key_widths_by_error(chosen, 1) == [2, 4, 2]
    assert key_widths_by_error(chosen, 2) == [2, 4, 4]


def test_value_widths_rank_by_the_values_own_errors():
    # keys gain most in layer 1, values in layer 3 (squared gains 0.0, 0.05, 0.0, 0.1575)
    rot = _rotations(
        [0.1, 0.3, 0.1, 0.1],
        [0.1, 0.2, 0.1, 0.1],
        value_errors=([0.2, 0.3, 0.2, 0.4], [0.2, 0.2, 0.2, 0.05]),
    )
    assert layers_by_gain(rot, role="value")[:2] == [3, 1]
    assert widths_by_error(rot, 1, role="value") == [2, 2, 2, 4]
    assert widths_by_error(rot, 1, role="key") == key_widths_by_error(rot, 1) == [2, 4, 2, 2]
    with pytest.raises(ValueError, match="role must be 'key' or 'value', got 'query'"):
        layers_by_gain(rot, role="query")
    keys_only = _rotations([0.1, 0.3, 0.1, 0.1], [0.1, 0.2, 0.1, 0.1])
    with pytest.raises(ValueError, match="no INT2 value clip fit in the header"):
        widths_by_error(keys_only, 1, role="value")


def test_layer_width_formats_and_value_clips_of_each_layers_width():
    rot = _rotations(
        [0.1, 0.3, 0.3, 0.1],
        [0.09, 0.05, 0.1, 0.1],
        value_errors=([0.3, 0.1, 0.3, 0.1], [0.0, 0.1, 0.2, 0.1]),
    )
    kbits, vbits = widths_by_error(rot, 2), widths_by_error(rot, 1, role="value")
    assert (kbits, vbits) == ([2, 4, 4, 2], [4, 2, 2, 2])
    base = _fmt(2, 2)
    formats = layer_width_formats(base, key_bits=kbits, value_bits=vbits)
    assert [(f.key.bits, f.value.bits) for f in formats] == list(zip(kbits, vbits))
    assert all(f.sink_tokens == 3 and f.key.group_size == 64 for f in formats)
    assert layer_width_formats(base, value_bits=vbits)[0].key == base.key
    assert layer_key_formats(base, kbits) == layer_width_formats(base, key_bits=kbits)
    cache = _cache(formats)
    apply_to_cache(rot, cache, clip_bits="cache")
    for layer, (kb, vb) in enumerate(zip(kbits, vbits)):
        tr = cache.transforms[layer]
        assert tr.key_clip == pytest.approx(float(rot.clips[(kb, "key")][layer]))
        assert tr.value_clip == pytest.approx(float(rot.clips[(vb, "value")][layer]))
    # (decode of caches whose layers' value widths differ: TOKEN_WISE, above)
    with pytest.raises(ValueError, match="give key_bits, value_bits or both"):
        layer_width_formats(base)
    with pytest.raises(ValueError, match="key_bits of 4, value_bits of 3"):
        layer_width_formats(base, key_bits=kbits, value_bits=vbits[:3])
    with pytest.raises(ValueError, match=r"value_bits\[0\] must be 2 or 4, got 8"):
        layer_width_formats(base, value_bits=[8, 2])
    with pytest.raises(TypeError, match="fmt must be a KVFormat"):
        layer_width_formats([base], key_bits=[2])


def test_layer_key_formats_and_clips_of_each_layers_width():
    rot = _rotations([0.1, 0.3, 0.3, 0.1], [0.09, 0.05, 0.1, 0.1])
    widths = key_widths_by_error(rot, 2)
    assert widths == [2, 4, 4, 2]
    formats = layer_key_formats(_fmt(2, 2), widths)
    assert [f.key.bits for f in formats] == widths
    assert all(f.value == _fmt(2, 2).value and f.sink_tokens == 3 for f in formats)
    cache = _cache(formats)
    apply_to_cache(rot, cache, clip_bits="cache")
    for layer, b in enumerate(widths):
        tr = cache.transforms[layer]
        assert tr.key_clip == pytest.approx(float(rot.clips[(b, "key")][layer]))
        assert tr.value_clip == pytest.approx(0.9)
    # a fixed width would give the INT4 layers INT2 clips: refused on a mixed cache
    fresh = _cache(formats)
    with pytest.raises(ValueError, match=r"clip_bits=2: layer 1 stores K INT4 / V INT2"):
        apply_to_cache(rot, fresh, clip_bits=2)
    # a width without fitted clips is refused before any layer changes
    del rot.clips[(4, "key")]
    before = list(fresh.transforms)
    with pytest.raises(ValueError, match=r"no key clip ratios were fitted for INT4"):
        apply_to_cache(rot, fresh, clip_bits="cache")
    with pytest.raises(ValueError, match="clip_bits must be a width, .* 'cache' or None"):
        apply_to_cache(rot, fresh, clip_bits="layers")
    assert all(a is b for a, b in zip(fresh.transforms, before))
    with pytest.raises(ValueError, match=r"key_bits\[1\] must be 2 or 4, got 2.9"):
        layer_key_formats(_fmt(2, 2), [2, 2.9])


def test_apply_to_cache_puts_back_the_layers_set_before_a_later_one_refuses():
    """GPTQ factors suit token-wise keys only: the second layer's channel-wise keys refuse them
    after the first layer took its transform, which must then be undone."""
    rot = _rotations([0.3, 0.1], [0.05, 0.09], layers=2)
    g = torch.Generator().manual_seed(2)
    r = torch.linalg.qr(torch.randn(2, 1, 64, 64, generator=g, dtype=torch.float64))[0]
    factors = torch.eye(64).expand(2, 2, 64, 64).contiguous()
    rot = OscarRotations(r, r, rot.clips, rot.header, factors)
    formats = (_fmt(2, 2, va="channel"), _fmt(2, 2, ka="channel", va="channel"))
    cache = _cache(formats)
    before = list(cache.transforms)
    with pytest.raises(ValueError, match="layer 1's keys are"):
        apply_to_cache(rot, cache, clip_bits="cache")
    assert all(a is b for a, b in zip(cache.transforms, before))
    assert cache.transforms[0].key_rotation is None


def test_oscar_cache_checks_the_clips_of_each_layers_width_at_construction():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    rot = _rotations([0.3, 0.1], [0.05, 0.09], layers=2)
    del rot.clips[(4, "key")]
    formats = layer_key_formats(_fmt(2, 2), [2, 4])
    with pytest.raises(ValueError, match="no key clip ratios were fitted for INT4"):
        oscar_cache(formats, cfg, rot, clip_bits="cache")
    with pytest.raises(ValueError, match="clip_bits must be a width"):
        oscar_cache(formats, cfg, rot, clip_bits="bogus")
    assert oscar_cache(formats, cfg, rot, clip_bits=None).fmt == formats


def test_rotated_mixed_cache_decodes_as_its_reference():
    """Rotations, per-layer clips and widths together: decode_attention (reference backend, in
    the model's coordinates) equals dequantize-then-attend layer by layer."""
    rot = _rotations([0.3, 0.1, 0.3, 0.1], [0.05, 0.09, 0.1, 0.1])
    g = torch.Generator().manual_seed(5)
    r = torch.linalg.qr(torch.randn(4, 1, 64, 64, generator=g, dtype=torch.float64))[0]
    rot = OscarRotations(r, r.flip(-1), rot.clips, rot.header)
    cache = _cache(layer_key_formats(_fmt(2, 2), key_widths_by_error(rot, 2)))
    apply_to_cache(rot, cache, clip_bits="cache")
    ids = _fill(cache)
    for layer in range(4):
        batch = cache.plan(ids, layer)
        q = torch.randn(len(ids), 4, 64, generator=g, dtype=torch.float64)
        o = decode_attention(q, cache, batch, backend="reference")
        ref, _ = attend_dequantized(q, cache, batch, 0.125)
        assert torch.allclose(o, ref, atol=1e-10, rtol=0)
