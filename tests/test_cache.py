"""Paged quantized cache: placement, windows, demotion, page tables, reuse, bad input."""

import math

import pytest
import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache, effective_bits
from foscar.formats import fold_scale_offset
from foscar.quantize import dequantize, quantize
from foscar.reference import dequantize_sequence

H, D = 2, 64


def make_cache(fmt, *, num_pages=64, max_seqs=4, page_size=16, num_layers=1, **kw):
    return QuantizedKVCache(
        fmt,
        num_kv_heads=H,
        head_dim=D,
        num_pages=num_pages,
        max_seqs=max_seqs,
        page_size=page_size,
        num_layers=num_layers,
        **kw,
    )


def expected_sequence(x: torch.Tensor, fmt: KVFormat, f: QuantFormat) -> torch.Tensor:
    """What the cache must return for all tokens ``x: [L, H, D]`` of one sequence: [H, L, D]."""
    length = x.shape[0]
    s0 = min(fmt.sink_tokens, length)
    past = length - fmt.sink_tokens - fmt.recent_tokens
    lq = max(0, past // fmt.demotion_quantum * fmt.demotion_quantum) if past > 0 else 0
    xh = x.transpose(0, 1).to(torch.bfloat16)  # the cache rounds every token to BF16 on entry
    parts = [xh[:, :s0].double()]
    if lq:
        hist = xh[:, fmt.sink_tokens : fmt.sink_tokens + lq]
        codes, s, z = quantize(hist, f)
        s, z = fold_scale_offset(s, z, f.bits, fmt.mapping)
        alpha, beta = fmt.mapping.alpha_beta(f.bits)
        parts.append(dequantize(codes.double() * alpha + beta, s, z, f, torch.float64))
    parts.append(xh[:, fmt.sink_tokens + lq :].double())
    return torch.cat(parts, dim=1)


FORMATS = [
    KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 32)),
    KVFormat(
        QuantFormat(4, "channel", 32), QuantFormat(2, "token", 64), sink_tokens=3, recent_tokens=5
    ),
    KVFormat(
        QuantFormat(2, "token", 32, clip=0.96),
        QuantFormat(4, "channel", 64, clip=0.92),
        sink_tokens=4,
        recent_tokens=0,
    ),
    KVFormat(QuantFormat(2, "channel", 64), QuantFormat(2, "channel", 32), recent_tokens=9),
    KVFormat(
        QuantFormat(4, "token", 64),
        QuantFormat(4, "token", 64),
        mapping="e4m3",
        sink_tokens=2,
        recent_tokens=3,
    ),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.short())
@pytest.mark.parametrize("page_size", [16, 32])
def test_round_trip_prefill_then_decode(fmt, page_size):
    torch.manual_seed(0)
    cache = make_cache(fmt, page_size=page_size)
    lens = [1, 37, 131]
    ids = [cache.add_sequence() for _ in lens]
    full = [torch.randn(n + 40, H, D) for n in lens]
    cache.append(
        ids,
        torch.cat([x[:n] for x, n in zip(full, lens)]),
        torch.cat([-x[:n] for x, n in zip(full, lens)]),
        lens,
    )
    for t in range(40):  # decode steps cross page, group and window boundaries
        k = torch.stack([x[n + t] for x, n in zip(full, lens)])
        cache.append(ids, k, -k)
    batch = cache.plan(ids)
    for i, (x, n) in enumerate(zip(full, lens)):
        k, v = dequantize_sequence(cache, batch, i)
        assert k.shape == (H, n + 40, D)
        torch.testing.assert_close(k, expected_sequence(x, fmt, fmt.key), rtol=0, atol=1e-5)
        torch.testing.assert_close(v, expected_sequence(-x, fmt, fmt.value), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.short())
def test_token_by_token_stores_the_same_bits_as_prefill(fmt):
    torch.manual_seed(1)
    x = torch.randn(150, H, D)
    a, b = make_cache(fmt), make_cache(fmt)
    sa, sb = a.add_sequence(), b.add_sequence()
    a.append([sa], x, 2 * x, [150])
    for t in range(150):
        b.append([sb], x[t : t + 1], 2 * x[t : t + 1])
    assert a.pages_of(sa) == b.pages_of(sb)
    for name, ta in a.layers[0].tensors().items():
        tb = b.layers[0].tensors()[name]
        if name.endswith("tail"):
            continue  # ring slots hold stale demoted tokens differently; compared via reads
        assert torch.equal(ta, tb), name
    ba, bb = a.plan([sa]), b.plan([sb])
    for ka, kb in zip(dequantize_sequence(a, ba, 0), dequantize_sequence(b, bb, 0)):
        assert torch.equal(ka, kb)


def test_page_table_csr_and_counts():
    fmt = KVFormat(
        QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), sink_tokens=4, recent_tokens=8
    )
    cache = make_cache(fmt, page_size=16)
    ids = [cache.add_sequence() for _ in range(3)]
    cache.append(ids, torch.randn(30 + 5 + 12, H, D), torch.randn(47, H, D), [30, 5, 12])
    b = cache.plan(ids)
    # L=30: Lq = 30 - 4 - 8 = 18 -> 2 pages, 2 tokens in the last; L=5: 0; L=12: 0
    assert b.num_quantized_host == [18, 0, 0]
    assert b.kv_indptr.tolist() == [0, 2, 2, 2]
    assert b.kv_last_page_len.tolist() == [2, 0, 0]
    assert b.kv_indptr.dtype == b.kv_indices.dtype == b.kv_last_page_len.dtype == torch.int32
    assert b.sink_len(1) == 4 and b.tail_range(1) == (4, 5) and b.tail_range(0) == (22, 30)
    # channel-wise groups wait for their g tokens
    fmt = KVFormat(QuantFormat(2, "channel", 32), QuantFormat(2, "token", 64))
    cache = make_cache(fmt, page_size=16)
    sid = cache.add_sequence()
    cache.append([sid], torch.randn(70, H, D), torch.randn(70, H, D), [70])
    b = cache.plan([sid])
    assert b.num_quantized_host == [64] and b.tail_range(0) == (64, 70)
    assert b.kv_indptr.tolist() == [0, 4] and b.kv_last_page_len.tolist() == [16]


def test_pages_are_distinct_and_reused_after_free():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(4, "token", 64))
    cache = make_cache(fmt, num_pages=10, page_size=16)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a, b], torch.randn(80, H, D), torch.randn(80, H, D), [50, 30])
    assert not set(cache.pages_of(a)) & set(cache.pages_of(b))
    assert cache.num_free_pages == 10 - 4 - 2
    freed = cache.pages_of(a)
    cache.free(a)
    assert cache.num_free_pages == 8
    c = cache.add_sequence()
    x = torch.randn(64, H, D)
    cache.append([c], x, x, [64])
    assert set(cache.pages_of(c)) == set(freed)  # reused
    k, _ = dequantize_sequence(cache, cache.plan([c]), 0)
    torch.testing.assert_close(k, expected_sequence(x, fmt, fmt.key), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.append([a], torch.randn(1, H, D), torch.randn(1, H, D))


def test_explicit_pages_are_used_in_order():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = make_cache(fmt, num_pages=10, page_size=16)
    sid = cache.add_sequence(pages=[7, 3])
    cache.append([sid], torch.randn(40, H, D), torch.randn(40, H, D), [40])
    assert cache.plan([sid]).pages_host == [[7, 3, cache.pages_of(sid)[2]]]
    assert cache.pages_of(sid)[2] not in (7, 3)


def test_added_pages_follow_the_held_ones_and_are_checked_first():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = make_cache(fmt, num_pages=10, page_size=16)
    a = cache.add_sequence(pages=[7])
    cache.add_sequence(pages=[2])  # another sequence holds page 2
    cache.append([a], torch.randn(10, H, D), torch.randn(10, H, D), [10])
    batch = cache.plan([a])
    cache.add_pages(a, [4, 9])
    assert cache.pages_of(a) == [7, 4, 9] and {4, 7, 9}.isdisjoint(cache.free_pages())
    assert len(cache.free_pages()) == 10 - 4
    cache.check_plan(batch)  # the pages its tokens sit in did not move
    cache.append([a], torch.randn(30, H, D), torch.randn(30, H, D), [30])
    assert cache.plan([a]).pages_host == [[7, 4, 9]]
    before = (cache.pages_of(a), cache.free_pages())
    for pages, message in [([2], "overlaps the pages of sequence"), ([10], "outside the pool"),
                           ([5, 5], "twice")]:
        with pytest.raises(ValueError, match=message):
            cache.add_pages(a, pages)
    with pytest.raises(ValueError, match="not a live sequence"):
        cache.add_pages("zzz", [5])
    assert (cache.pages_of(a), cache.free_pages()) == before
    cache.free(a)
    assert {4, 7, 9} <= cache.free_pages()


def test_free_page_set_follows_every_change_of_the_pool():
    """The free pages as a set (page_is_free, free_pages) equal the free stack after explicit
    pages, added pages, appends that take pages, frees and a benchmark's reordering; the
    reordering must list exactly the free pages."""
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = make_cache(fmt, num_pages=12, page_size=16)

    def consistent():
        stack = cache.free_page_order()
        assert len(set(stack)) == len(stack) == cache.num_free_pages
        assert cache.free_pages() == frozenset(stack)
        assert [p for p in range(12) if cache.page_is_free(p)] == sorted(stack)

    a = cache.add_sequence(pages=[5, 0])
    consistent()
    b = cache.add_sequence()
    cache.append([a, b], torch.randn(70, H, D), torch.randn(70, H, D), [40, 30])  # pops 4
    consistent()
    cache.add_pages(b, [11])
    cache.add_pages(b, [])
    consistent()
    assert not cache.page_is_free(11) and not cache.page_is_free(5)
    cache.free(a)
    consistent()
    assert cache.page_is_free(5) and cache.page_is_free(0)
    order = sorted(cache.free_page_order())
    cache.set_free_order(order)
    consistent()
    c = cache.add_sequence()
    cache.append([c], torch.randn(20, H, D), torch.randn(20, H, D), [20])
    assert cache.pages_of(c) == order[-1:-3:-1]  # the last listed is taken first
    consistent()
    for bad in (order[:-1], [*order, 99], [cache.pages_of(b)[0], *order[3:]]):
        with pytest.raises(ValueError, match="every free page once"):
            cache.set_free_order(bad)
    consistent()


def test_layers_share_pages_but_not_storage():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = make_cache(fmt, num_layers=2)
    sid = cache.add_sequence()
    x0, x1 = torch.randn(40, H, D), torch.randn(40, H, D)
    cache.append([sid], x0, x0, [40], layer=0)
    cache.append([sid], x1, x1, [40], layer=1)
    for layer, x in ((0, x0), (1, x1)):
        k, _ = dequantize_sequence(cache, cache.plan([sid], layer=layer), 0)
        torch.testing.assert_close(k, expected_sequence(x, fmt, fmt.key), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- accounting
def test_oscar_effective_bits_example():
    fmt = KVFormat(
        QuantFormat(2, "token", 128),
        QuantFormat(2, "token", 128),
        sink_tokens=64,
        recent_tokens=256,
    )
    assert round(effective_bits(131072, fmt, scale_bits=16), 4) == 2.2836
    assert effective_bits(131072, KVFormat(), scale_bits=32) == 2.5


def test_memory_stats_match_the_formula():
    fmt = KVFormat(
        QuantFormat(2, "token", 64), QuantFormat(4, "channel", 32), sink_tokens=3, recent_tokens=7
    )
    cache = make_cache(fmt, page_size=16)
    sid = cache.add_sequence()
    cache.append([sid], torch.randn(200, H, D), torch.randn(200, H, D), [200])
    stats = cache.memory_stats()
    assert stats["tokens"] == 200
    assert stats["effective_bits"] == pytest.approx(effective_bits(200, fmt))
    assert stats["bf16_bytes"] == 200 * 2 * H * D * 2
    lq = stats["quantized_tokens"]
    assert lq == (200 - 10) // 32 * 32
    expected = lq * H * (D * 6 / 8 + 8 * (D / 64 + D / 32)) + (200 - lq) * 2 * H * D * 2
    assert stats["used_bytes"] == expected


# ---------------------------------------------------------------------------- bad input
def snapshot(cache):
    tensors = [{k: t.clone() for k, t in st.tensors().items()} for st in cache.layers]
    seqs = {s: cache.sequence_state(s) for s in cache.sequences}
    return tensors, cache.free_page_order(), cache.free_pages(), cache.free_slot_order(), seqs


def assert_unchanged(cache, snap):
    tensors, free_pages, free_set, free_slots, seqs = snap
    for st, saved in zip(cache.layers, tensors):
        for k, t in st.tensors().items():
            assert torch.equal(t, saved[k]), k
    assert cache.free_page_order() == free_pages and cache.free_pages() == free_set
    assert cache.free_slot_order() == free_slots
    assert {s: cache.sequence_state(s) for s in cache.sequences} == seqs


@pytest.fixture
def busy_cache():
    fmt = KVFormat(
        QuantFormat(2, "channel", 32), QuantFormat(2, "token", 64), sink_tokens=2, recent_tokens=4
    )
    cache = make_cache(fmt, num_pages=8, max_seqs=3, page_size=16)
    a, b = cache.add_sequence("a"), cache.add_sequence("b")
    cache.append([a, b], torch.randn(90, H, D), torch.randn(90, H, D), [60, 30])
    return cache


def ok(n=1):
    return torch.randn(n, H, D)


BAD_APPENDS = [
    ("k must be a torch.Tensor", lambda c: c.append(["a"], [[0.0]], ok())),
    (
        "k must be bfloat16, float16, float32 or float64",
        lambda c: c.append(["a"], ok().int(), ok()),
    ),
    ("v must have shape", lambda c: c.append(["a"], ok(), torch.randn(1, H, D + 1))),
    ("k must have shape \\[num_tokens=3", lambda c: c.append(["a"], ok(2), ok(2), [3])),
    ("k is on meta", lambda c: c.append(["a"], ok().to("meta"), ok())),
    (
        "k contains NaN or Inf",
        lambda c: c.append(["a"], ok().index_fill_(2, torch.tensor([5]), math.nan), ok()),
    ),
    (
        "v contains NaN or Inf",
        lambda c: c.append(["a"], ok(), ok().index_fill_(1, torch.tensor([0]), math.inf)),
    ),
    ("seq_ids\\[1\\] 'zzz' is not a live sequence", lambda c: c.append(["a", "zzz"], ok(2), ok(2))),
    ("seq_ids must be distinct", lambda c: c.append(["a", "a"], ok(2), ok(2))),
    ("num_new_tokens has 1 entries", lambda c: c.append(["a", "b"], ok(2), ok(2), [2])),
    ("num_new_tokens\\[0\\] must be >= 1", lambda c: c.append(["a"], ok(0), ok(0), [0])),
    ("layer must be in \\[0, 1\\)", lambda c: c.append(["a"], ok(), ok(), layer=1)),
    # "b" would fit; "a" needs more pages than are free: nothing may be written for either
    ("page pool exhausted", lambda c: c.append(["b", "a"], ok(1 + 200), ok(201), [1, 200])),
    ("pages\\[1\\] = 8 points outside the pool", lambda c: c.add_sequence(pages=[0, 8])),
    ("overlaps the pages of sequence 'a'", lambda c: c.add_sequence(pages=[c.pages_of("a")[0]])),
    ("pages lists a page twice", lambda c: c.add_sequence(pages=[5, 5])),
    ("already a live sequence", lambda c: c.add_sequence("a")),
    ("seq_id 'q' is not a live sequence", lambda c: c.free("q")),
    ("seq_ids\\[0\\] 'q' is not a live sequence", lambda c: c.plan(["q"])),
]


@pytest.mark.parametrize("message,call", BAD_APPENDS, ids=[m for m, _ in BAD_APPENDS])
def test_rejected_calls_change_nothing(busy_cache, message, call):
    snap = snapshot(busy_cache)
    with pytest.raises((ValueError, TypeError), match=message):
        call(busy_cache)
    assert_unchanged(busy_cache, snap)


def test_max_seqs_and_empty_sequences(busy_cache):
    busy_cache.add_sequence("c")
    snap = snapshot(busy_cache)
    with pytest.raises(ValueError, match="max_seqs \\(3\\) sequences are already live"):
        busy_cache.add_sequence("d")
    with pytest.raises(ValueError, match="has no tokens in layer 0"):
        busy_cache.plan(["c"])
    assert_unchanged(busy_cache, snap)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"page_size": 48}, "page_size must be a power of two from 16 to 256"),
        ({"page_size": 512}, "page_size must be a power of two from 16 to 256"),
        ({"head_dim": 72}, "head_dim must be a positive multiple of 16"),
        ({"head_dim": 48}, "divisible by key.group_size"),
        ({"num_pages": 0}, "num_pages must be >= 1"),
        ({"num_kv_heads": 2.0}, "num_kv_heads must be an int"),
    ],
)
def test_constructor_validation(kwargs, message):
    args = dict(num_kv_heads=2, head_dim=64, num_pages=4, max_seqs=2)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        QuantizedKVCache(KVFormat(QuantFormat(2, "token", 32)), **args)
