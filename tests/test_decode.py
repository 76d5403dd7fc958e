"""decode_attention's reference backend (the CPU path of every integration) against fp64 ground
truth, over sequences that span several of its tiles."""

import pytest
import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache, decode_attention
from foscar.backends import REFERENCE_BLOCK_N
from foscar.reference import attend_dequantized

AXES = [("token", "token"), ("channel", "token"), ("token", "channel"), ("channel", "channel")]


@pytest.mark.parametrize("k_axis,v_axis", AXES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_backend_across_tiles(k_axis, v_axis, dtype):
    torch.manual_seed(0)
    fmt = KVFormat(
        QuantFormat(2, k_axis, 64), QuantFormat(4, v_axis, 64), sink_tokens=16, recent_tokens=40
    )
    cache = QuantizedKVCache(
        fmt, num_kv_heads=2, head_dim=64, num_pages=96, max_seqs=2, page_size=64
    )
    ids = [cache.add_sequence(), cache.add_sequence()]
    lengths = [2 * REFERENCE_BLOCK_N + 300, 200]  # three tiles, and less than one
    k = torch.randn(sum(lengths), 2, 64)
    v = torch.randn(sum(lengths), 2, 64)
    cache.append(ids, k, v, num_new_tokens=lengths)
    batch = cache.plan(ids)
    q = torch.randn(2, 6, 64, dtype=dtype)
    o, lse = decode_attention(q, cache, batch, backend="reference", return_lse=True)
    o_ref, lse_ref = attend_dequantized(q, cache, batch)
    assert o.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(o.double(), o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-4, rtol=1e-4)  # lse is fp32


def test_kernel_backends_answer_coverage_once_per_cache_and_head_count(monkeypatch):
    """A kernel backend checks a cache's coverage once per query head count (a cache's formats
    and shape never change): the same answer after, refusals included, each cache and head
    count its own, and the memo does not keep a cache alive."""
    import gc
    import weakref

    from foscar import backends

    triton = backends.get("triton")
    calls = []
    check = triton.module.supports

    def counted(cache, num_q_heads):
        calls.append(num_q_heads)
        return check(cache, num_q_heads)

    monkeypatch.setattr(triton.module, "supports", counted)
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = QuantizedKVCache(fmt, num_kv_heads=2, head_dim=64, num_pages=4, max_seqs=1)
    small = KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "token", 32))
    other = QuantizedKVCache(small, num_kv_heads=2, head_dim=32, num_pages=4, max_seqs=1)
    for _ in range(3):
        assert triton.supports(cache, 4) is None
        assert "head_dim must be 64 or 128" in triton.supports(other, 4)
        assert triton.supports(cache, 6) == check(cache, 6)
    assert calls == [4, 4, 6]  # once each for (cache, 4), (other, 4), (cache, 6)
    alive = weakref.ref(other)
    del other
    gc.collect()
    assert alive() is None
