"""The fused decode-step write (foscar.kernels.cache_write, one Triton launch per role) against
the cache's torch writer, bit for bit: every pool, scale and window tensor after every step, for
both bit widths, every operand mapping, group sizes, windows, ragged batches, rotations, page
boundaries; and the cases it must refuse. Runs through the Triton interpreter on a CPU."""

import warnings

import pytest
import torch
from conftest import KERNEL_DEVICE

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.backends import triton as triton_backend
from foscar.cache import fused_write

pytestmark = pytest.mark.skipif(
    not triton_backend.available(torch.device(KERNEL_DEVICE)), reason="Triton is not installed"
)

CASES = [
    # (K bits, V bits, group, head_dim, sink, recent, mapping)
    (2, 2, 128, 128, 0, 0, "bf16"),  # no windows: the new token itself is quantized
    (4, 4, 32, 128, 4, 8, "bf16"),
    (4, 2, 64, 64, 3, 0, "bf16"),  # a sink only
    (2, 4, 32, 64, 0, 5, "bf16"),  # a recent window only
    (2, 2, 32, 64, 2, 6, "e4m3"),
    (2, 2, 64, 64, 0, 3, "e2m1"),
    (4, 4, 64, 64, 1, 1, "e4m3"),
]


def _snapshot(cache):
    """Every pool tensor's bytes (NaN and the sign of zero compared bit for bit)."""
    return [
        t.contiguous().view(torch.uint8).clone()
        for st in cache.layers
        for t in st.tensors().values()
    ]


def _pair(fmt, head_dim, max_seqs=4, paths=("torch", "fused"), **kw):
    return [
        QuantizedKVCache(
            fmt,
            num_kv_heads=2,
            head_dim=head_dim,
            num_pages=48,
            max_seqs=max_seqs,
            num_layers=2,
            page_size=16,
            device=KERNEL_DEVICE,
            decode_write=path,
            **kw,
        )
        for path in paths
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "K{}V{}-g{}-d{}-s{}w{}-{}".format(*c))
def test_fused_write_equals_torch_write(case, monkeypatch):
    kb, vb, g, d, sink, recent, mapping = case
    launches = []
    launch = fused_write.write_decode_tokens
    monkeypatch.setattr(
        fused_write, "write_decode_tokens", lambda *a: launches.append(a[2]) or launch(*a)
    )
    fmt = KVFormat(
        QuantFormat(kb, "token", g),
        QuantFormat(vb, "token", g),
        mapping=mapping,
        sink_tokens=sink,
        recent_tokens=recent,
    )
    caches = _pair(fmt, d)
    gen = torch.Generator().manual_seed(0)
    prompt = [0, 2, 23]  # empty, inside the sink, past the windows and a page
    ids = [[c.add_sequence() for _ in prompt] for c in caches]
    n = [p for p in prompt if p]
    for layer in range(2):
        x = torch.randn(sum(n), 2, d, generator=gen).to(KERNEL_DEVICE)
        for c, cid in zip(caches, ids):
            c.append([i for i, p in zip(cid, prompt) if p], x, x * 2, n, layer=layer)
    for step in range(17):  # page size 16: every sequence crosses a page, the empty one last
        for layer in range(2):
            # bf16 input on even steps (the model's dtype), fp32 on odd ones (rounded on entry);
            # outliers make groups with very different ranges
            dtype = torch.bfloat16 if step % 2 == 0 else torch.float32
            k = (torch.randn(3, 2, d, generator=gen) * torch.rand(1, 1, d, generator=gen) * 4).to(
                dtype
            )
            v = torch.randn(3, 2, d, generator=gen).to(dtype)
            v[0, 0, 0] = 30.0
            for c, cid in zip(caches, ids):
                c.append(cid, k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), layer=layer)
        for a, b in zip(_snapshot(caches[0]), _snapshot(caches[1])):
            assert torch.equal(a, b), f"step {step}"
    assert caches[1].seq_len(ids[1][0]) == 17 and caches[1].seq_len(ids[1][2]) == 40
    assert launches == ["k", "v"] * 17 * 2  # the fused cache took the kernel at every step


def test_fused_write_with_rotations_and_a_strided_input():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), recent_tokens=4)
    caches = _pair(fmt, 64)
    r = torch.linalg.qr(torch.randn(2, 64, 64, dtype=torch.float64))[0]
    for c in caches:
        c.set_transform(1, key_rotation=r, value_rotation=r.flip(-1))
    ids = [[c.add_sequence() for _ in range(2)] for c in caches]
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        for layer in range(2):
            kv = torch.randn(2, 2, 2, 64, generator=gen).to(KERNEL_DEVICE)  # [B, K|V, H, D]
            for c, cid in zip(caches, ids):
                c.append(cid, kv[:, 0], kv[:, 1], layer=layer)  # non-contiguous batch stride
        for a, b in zip(_snapshot(caches[0]), _snapshot(caches[1])):
            assert torch.equal(a, b), f"step {step}"


@pytest.mark.parametrize("window_dtype", [torch.float16, torch.float32])
def test_fused_write_reordered_subsets_other_window_dtypes(window_dtype):
    """Rows in a changing order and subset (batch position != slot), layers written at
    different steps, fp16/fp32 windows, head_dim 256."""
    fmt = KVFormat(
        QuantFormat(4, "token", 128), QuantFormat(2, "token", 64), sink_tokens=2, recent_tokens=3
    )
    caches = _pair(fmt, 256, max_seqs=5, window_dtype=window_dtype)
    ids = [[c.add_sequence() for _ in range(5)] for c in caches]
    gen = torch.Generator().manual_seed(2)
    for step in range(14):
        pick = torch.randperm(5, generator=gen)[: 1 + step % 5].tolist()
        for layer in (0, 1) if step % 3 else (1,):  # layer 0 lags behind on some steps
            kv = torch.randn(2, len(pick), 2, 256, generator=gen).to(KERNEL_DEVICE)
            for c, cid in zip(caches, ids):
                c.append([cid[j] for j in pick], kv[0], kv[1], layer=layer)
        for a, b in zip(_snapshot(caches[0]), _snapshot(caches[1])):
            assert torch.equal(a, b), f"step {step}"
    assert caches[0].seq_len(ids[0][0], 1) != caches[0].seq_len(ids[0][0], 0)


def _gptq_factors(heads, d, gen):
    """Upper-triangular GPTQ factors of random dense metrics (one per KV head)."""
    from foscar.quantize import gptq_factor

    a = torch.randn(heads, d, d, generator=gen, dtype=torch.float64)
    return gptq_factor(a @ a.transpose(-1, -2) / d + torch.eye(d, dtype=torch.float64))


@pytest.mark.parametrize(
    "kb, vb, g, d, sink, recent",
    [(2, 2, 64, 64, 2, 4), (4, 2, 32, 128, 0, 0), (2, 4, 32, 64, 0, 3)],
    ids=["K2V2-g64-d64-s2w4", "K4V2-g32-d128-nowindows", "K2V4-g32-d64-w3"],
)
def test_fused_write_with_clips_and_gptq_keys_equals_torch_write(kb, vb, g, d, sink, recent):
    """OSCAR's layers: rotated, clipped per token (a format's ratio, and per-layer ratios of K
    and V that replace it) and keys rounded by GPTQ; the fused write stores what the torch
    writer does, bit for bit, every step. Outliers make the clip bite."""
    fmt = KVFormat(
        QuantFormat(kb, "token", g, clip=0.9),
        QuantFormat(vb, "token", g),
        sink_tokens=sink,
        recent_tokens=recent,
    )
    caches = _pair(fmt, d)
    gen = torch.Generator().manual_seed(3)
    r = torch.linalg.qr(torch.randn(2, d, d, dtype=torch.float64, generator=gen))[0]
    factors = _gptq_factors(2, d, gen)
    for c in caches:
        # layer 0: the format's K clip with GPTQ keys; layer 1: rotations, per-layer clips
        c.set_transform(0, key_gptq=factors)
        c.set_transform(1, key_rotation=r, value_rotation=r, key_clip=0.75, value_clip=0.8,
                        key_gptq=factors.flip(0))  # fmt: skip
        assert c.fused_write_reason(0) is None and c.fused_write_reason(1) is None
    # a third cache rounds K to nearest: GPTQ must store other codes, or this test is blind
    (nearest,) = _pair(fmt, d, paths=("torch",))
    nearest.set_transform(1, key_rotation=r, value_rotation=r, key_clip=0.75, value_clip=0.8)
    caches.append(nearest)
    ids = [[c.add_sequence() for _ in range(3)] for c in caches]
    prompt = [9, 1, 4]  # a prefill first (the torch path on both), some tokens past the windows
    for layer in range(2):
        x = torch.randn(sum(prompt), 2, d, generator=gen).to(KERNEL_DEVICE)
        for c, cid in zip(caches, ids):
            c.append(cid, x, -x, prompt, layer=layer)
    for step in range(4):
        for layer in range(2):
            spread = 1 + 6 * torch.rand(3, 2, d, generator=gen) ** 8
            k = torch.randn(3, 2, d, generator=gen) * spread
            v = torch.randn(3, 2, d, generator=gen).to(torch.bfloat16)
            for c, cid in zip(caches, ids):
                c.append(cid, k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), layer=layer)
        for a, b in zip(_snapshot(caches[0]), _snapshot(caches[1])):
            assert torch.equal(a, b), f"step {step}"
    for layer in range(2):
        gptq_words, nearest_words = caches[0].layers[layer].k_words, nearest.layers[layer].k_words
        assert not torch.equal(gptq_words, nearest_words)
        # same clip, same scales: only the codes differ
        assert torch.equal(caches[0].layers[layer].k_scales, nearest.layers[layer].k_scales)


@pytest.mark.parametrize(
    "clip, nans, poisoned, gptq",
    [
        (None, [40], [1], False),
        (0.9, [40], [1], False),
        (0.9, list(range(8, 16)), [0, 1], False),
        (0.9, [40], [1], True),
    ],
    ids=["unclipped", "clipped-tau-finite", "clipped-tau-nan", "clipped-gptq"],
)
def test_fused_write_poisons_a_group_with_a_nan(clip, nans, poisoned, gptq):
    """check_finite=False: a NaN poisons its group's (s', z') on both paths (the codes of such a
    group are unspecified; with GPTQ keys those of the whole token, the error being fed
    forward), every other entry is bit for bit the same. Clipped rows order NaN above every
    number, as torch.kthvalue does: the 0.9 percentile of 64 values is the one of 0-based rank
    57, so one NaN (rank 63) leaves it finite and eight (ranks 56-63) make it NaN, poisoning
    the whole row."""
    fmt = KVFormat(QuantFormat(2, "token", 32, clip=clip), QuantFormat(2, "token", 32))
    caches = _pair(fmt, 64, check_finite=False)
    if gptq:
        factors = _gptq_factors(2, 64, torch.Generator().manual_seed(4))
        for c in caches:
            c.set_transform(0, key_gptq=factors)
    ids = [c.add_sequence() for c in caches]
    k = torch.randn(3, 1, 2, 64)
    k[1, 0, 1, nans] = float("nan")  # step 1, head 1
    for step in range(3):
        for c, sid in zip(caches, ids):
            x = k[step].to(KERNEL_DEVICE)
            c.append([sid], x, x)
    sa, sb = caches[0].layers[0].k_scales, caches[1].layers[0].k_scales
    page = caches[0].pages_of(ids[0])[0]
    for g in poisoned:  # row 1 of head 1, group g
        assert sa[page, 1, 2 + g].isnan().all() and sb[page, 1, 2 + g].isnan().all()
    keep = ~sa.isnan()
    assert torch.equal(sa[keep], sb[keep]) and keep.sum() == sa.numel() - 2 * len(poisoned)
    wa, wb = caches[0].layers[0].k_words, caches[1].layers[0].k_words
    wa[page, 1, 1], wb[page, 1, 1] = 0, 0  # the poisoned row's codes: unspecified
    assert torch.equal(wa, wb)


@pytest.mark.parametrize("mapping", ["bf16", "e4m3"])
def test_fused_write_stores_a_zero_minimum_as_plus_zero(mapping):
    """A clipped row whose percentile is 0 (most of its values are zero) holds +0 and -0 after
    the clamp, and a group of zeros of both signs has either as its minimum: both paths store
    +0 (the e4m3 mapping stores the minimum itself as z')."""
    fmt = KVFormat(
        QuantFormat(2, "token", 32, clip=0.9), QuantFormat(2, "token", 32), mapping=mapping
    )
    caches = _pair(fmt, 64)
    ids = [c.add_sequence() for c in caches]
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        k = torch.zeros(1, 2, 64)
        k[0, 0, :4] = torch.randn(4, generator=gen)  # 60 zeros: the 0.9 percentile is 0
        k[0, 0, 4:40:2] = -0.0
        v = torch.zeros(1, 2, 64)
        v[0, 1, 1:32:3] = -0.0  # a group of signed zeros, unclipped
        v[0, 1, 40] = 1.0
        for c, sid in zip(caches, ids):
            c.append([sid], k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE))
    for a, b in zip(_snapshot(caches[0]), _snapshot(caches[1])):
        assert torch.equal(a, b)
    z = caches[1].layers[0].k_scales[..., 1]
    assert not torch.signbit(z[z == 0]).any()


def test_auto_falls_back_to_torch_when_the_kernel_fails(monkeypatch):
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), recent_tokens=2)
    torch_cache, auto = _pair(fmt, 64)
    auto.decode_write = "auto"
    # "auto" takes the fused write on CUDA only; take it here too, until a failure is recorded
    monkeypatch.setattr(auto, "_fused_write", lambda layer: auto.fused_write_state.failure is None)

    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fused_write, "write_decode_tokens", broken)
    ids = [c.add_sequence() for c in (torch_cache, auto)]
    x = torch.randn(5, 2, 64).to(KERNEL_DEVICE)
    for c, sid in zip((torch_cache, auto), ids):
        c.append([sid], x[:3], x[:3], [3])
    with pytest.warns(RuntimeWarning, match="fused decode write failed.*no compiler"):
        auto.append([ids[1]], x[3:4], x[3:4])
    torch_cache.append([ids[0]], x[3:4], x[3:4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: torch from now on
        auto.append([ids[1]], x[4:], x[4:])
    torch_cache.append([ids[0]], x[4:], x[4:])
    for a, b in zip(_snapshot(torch_cache), _snapshot(auto)):
        assert torch.equal(a, b)


def test_fused_write_refusals_leave_the_cache_unchanged():
    channel = KVFormat(QuantFormat(2, "channel", 32), QuantFormat(2, "token", 64))
    channel_v = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "channel", 32))
    for fmt, why in ((channel, "k history .*channel-wise"), (channel_v, "v history .*channel")):
        with pytest.raises(ValueError, match=f"decode_write='fused' cannot.*{why}"):
            _pair(fmt, 64)  # at construction
        (cache,) = _pair(fmt, 64, paths=("torch",))
        cache.decode_write = "fused"  # a cache whose format passed, then changed underneath
        sid = cache.add_sequence()
        x = torch.randn(41, 2, 64, device=KERNEL_DEVICE)
        cache.append([sid], x[:40], x[:40], [40])
        before, pages = _snapshot(cache), cache.free_page_order()
        with pytest.raises(ValueError, match=f"decode_write='fused' cannot.*{why}"):
            cache.append([sid], x[40:], x[40:])
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(cache)))
        assert cache.free_page_order() == pages and cache.seq_len(sid) == 40
    # OSCAR's layers (per-layer clips, GPTQ keys) take the fused write; head_dim 96 does not
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = _pair(fmt, 64)[1]
    cache.set_transform(1, value_clip=0.95, key_gptq=torch.eye(64))
    assert cache.fused_write_reason(0) is None and cache.fused_write_reason(1) is None
    odd = KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "token", 32))
    (cache,) = _pair(odd, 96, paths=("torch",))
    assert cache.fused_write_reason(0) == "head_dim must be a power of two >= 16, got 96"
    with pytest.raises(ValueError, match="decode_write must be one of"):
        QuantizedKVCache(
            fmt, num_kv_heads=2, head_dim=64, num_pages=4, max_seqs=1, decode_write="x"
        )


def test_auto_takes_the_torch_path_on_a_cpu(monkeypatch):
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = QuantizedKVCache(fmt, num_kv_heads=2, head_dim=64, num_pages=4, max_seqs=1)
    assert cache.decode_write == "auto"

    def fused(*args):
        raise AssertionError("the fused write ran on a CPU cache")

    monkeypatch.setattr(fused_write, "write_decode_tokens", fused)
    sid = cache.add_sequence()
    x = torch.randn(4, 2, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fused write's failure would only warn
        cache.append([sid], x[:3], x[:3], [3])
        cache.append([sid], x[3:], x[3:])  # a decode step's token: the torch write
    assert cache.seq_len(sid) == 4
