"""Decode plans against the cache's state: a plan goes stale when a sequence it covers is freed
or appended to in its layer, and decoding a stale plan raises before any work; a plan whose
sequences did not change stays usable (decode loops, layers of one step, graph-style reuse).
Also the cache's docstring example and the append error a new user meets first."""

import pytest
import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache, decode_attention
from foscar.reference import attend_dequantized, dequantize_sequence

H, D = 2, 64
FMT = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64), recent_tokens=4)


def _cache(num_layers=2, num_pages=16, max_seqs=3):
    return QuantizedKVCache(
        FMT,
        num_kv_heads=H,
        head_dim=D,
        num_pages=num_pages,
        max_seqs=max_seqs,
        num_layers=num_layers,
        page_size=16,
    )


def _prefill(cache, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [cache.add_sequence() for _ in lengths]
    for layer in range(cache.num_layers):
        k = torch.randn(sum(lengths), H, D, generator=g)
        cache.append(ids, k, -k, num_new_tokens=lengths, layer=layer)
    return ids


def _step(cache, ids, layer, seed=1):
    k = torch.randn(len(ids), H, D, generator=torch.Generator().manual_seed(seed))
    cache.append(ids, k, 2 * k, layer=layer)


def _q(batch):
    return torch.randn(batch.batch_size, 2 * H, D, generator=torch.Generator().manual_seed(2))


def test_docstring_example_runs():
    fmt = KVFormat(QuantFormat(2, "token", 128), QuantFormat(2, "token", 128))
    cache = QuantizedKVCache(fmt, num_kv_heads=8, head_dim=128, num_pages=64, max_seqs=4)
    sid = cache.add_sequence()
    k = v = torch.randn(300, 8, 128, dtype=torch.bfloat16)
    cache.append([sid], k, v, num_new_tokens=[300])
    batch = cache.plan([sid])
    step = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    cache.append([sid], step, step)
    batch = cache.plan([sid])
    assert batch.seq_lens_host == [301]


def test_multi_token_append_without_counts_names_num_new_tokens():
    cache = _cache()
    sid = cache.add_sequence()
    k = torch.randn(30, H, D)
    with pytest.raises(
        ValueError, match=r"k holds 30 tokens, not one per sequence \(1\).*num_new_tokens=\[30\]"
    ):
        cache.append([sid], k, k)
    assert cache.seq_len(sid) == 0  # nothing was written
    cache.append([sid], k, k, num_new_tokens=[30])
    assert cache.seq_len(sid) == 30


def test_plan_then_free_raises_at_decode():
    cache = _cache()
    ids = _prefill(cache, [40, 25])
    batch = cache.plan(ids)
    cache.free(ids[1])
    with pytest.raises(ValueError, match=r"stale plan: seq_ids\[1\] = 1 was freed"):
        decode_attention(_q(batch), cache, batch)
    with pytest.raises(ValueError, match="stale plan"):
        attend_dequantized(_q(batch), cache, batch)
    with pytest.raises(ValueError, match="stale plan"):
        dequantize_sequence(cache, batch, 0)


def test_plan_then_free_and_reuse_raises_at_decode():
    cache = _cache()
    ids = _prefill(cache, [40, 25])
    batch = cache.plan(ids)
    freed = cache.pages_of(ids[0])
    cache.free(ids[0])
    # the same id and the freed pages, now another sequence of the same length
    sid = cache.add_sequence(ids[0], pages=freed)
    for layer in range(2):
        cache.append([sid], torch.randn(40, H, D), torch.randn(40, H, D), [40], layer=layer)
    assert cache.pages_of(sid)[: len(freed)] == freed and cache.seq_len(sid) == 40
    with pytest.raises(ValueError, match=r"stale plan: seq_ids\[0\] = 0 was freed"):
        decode_attention(_q(batch), cache, batch)


def test_append_to_the_planned_layer_makes_the_plan_stale():
    cache = _cache()
    ids = _prefill(cache, [40, 25])
    batch = cache.plan(ids, layer=1)
    _step(cache, ids[:1], layer=1)
    with pytest.raises(
        ValueError, match=r"stale plan: seq_ids\[0\] = 0 holds 41 tokens in layer 1"
    ):
        decode_attention(_q(batch), cache, batch)
    fresh = cache.plan(ids, layer=1)
    decode_attention(_q(fresh), cache, fresh)


def test_plans_stay_valid_while_their_sequences_do_not_change():
    """The integrations' decode loop: every step appends each layer, plans once after layer 0's
    append and points that plan at the other layers; a plan is reused as a CUDA graph replays
    it; unrelated sequences come and go."""
    cache = _cache(num_layers=2, num_pages=24)
    ids = _prefill(cache, [47, 27])
    for step in range(6):  # 43 -> 49 quantized tokens: crosses a page boundary
        batch = None
        for layer in range(2):
            _step(cache, ids, layer, seed=step)
            if batch is None:
                batch = cache.plan(ids, layer)
                planned_at = layer
            layer_batch = batch.for_layer(layer)
            q = _q(layer_batch)
            o = decode_attention(q, cache, layer_batch)
            if step == 5:  # the reused plan reads what a fresh one reads; replays agree
                expected = decode_attention(q, cache, cache.plan(ids, layer))
                torch.testing.assert_close(o, expected, atol=0, rtol=0)
                again = decode_attention(q, cache, layer_batch)
                torch.testing.assert_close(again, o, atol=0, rtol=0)
        assert planned_at == 0
    assert len(cache.pages_of(ids[0])) == 4  # 3 pages after the prefill
    # a plan of layer 0 outlives appends to layer 1, and other sequences' lives
    batch = cache.plan(ids, 0)
    other = cache.add_sequence()
    _step(cache, ids, layer=1)
    cache.append([other], torch.randn(30, H, D), torch.randn(30, H, D), [30])
    cache.free(other)
    q = _q(batch)
    torch.testing.assert_close(
        decode_attention(q, cache, batch), decode_attention(q, cache, cache.plan(ids, 0))
    )


def test_a_plan_of_another_cache_is_refused():
    a, b = _cache(), _cache()
    ids = _prefill(a, [20])
    _prefill(b, [20])
    batch = a.plan(ids)
    with pytest.raises(ValueError, match="stale plan.*another cache"):
        decode_attention(_q(batch), b, batch)
