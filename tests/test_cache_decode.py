"""The cache's decode-step writer (one token per sequence) against its general writer, bit for
bit: every pool, window and scale tensor, page lists and lengths, after every step."""

import pytest
import torch

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.cache import write

FORMATS = [
    # (K, V, sink, recent): token- and channel-wise groups, no windows, a sink only, a recent
    # window only (a token-wise format then demotes the new token itself when W = 0)
    (("token", 32), ("token", 32), 0, 0),
    (("token", 64), ("channel", 32), 4, 8),
    (("channel", 32), ("token", 64), 0, 8),
    (("channel", 32), ("channel", 64), 5, 0),
    (("token", 32), ("token", 64), 3, 0),
]


def _snapshot(cache):
    state = [t.clone() for st in cache.layers for t in st.tensors().values()]
    seqs = {s: cache.sequence_state(s) for s in cache.sequences}
    return state, seqs, cache.free_page_order()


def _general_writer(cache, layer, seqs, lengths, k, v, fused=False):
    """The prefill path, given a decode step."""
    write.write_tokens(cache, layer, seqs, lengths, [1] * len(seqs), k, v)


@pytest.mark.parametrize("fmt_args", FORMATS)
def test_decode_writer_equals_general_writer(fmt_args, monkeypatch):
    (ka, kg), (va, vg), sink, recent = fmt_args
    fmt = KVFormat(
        QuantFormat(2, ka, kg), QuantFormat(4, va, vg), sink_tokens=sink, recent_tokens=recent
    )
    caches = [
        QuantizedKVCache(
            fmt, num_kv_heads=2, head_dim=64, num_pages=64, max_seqs=4, num_layers=2, page_size=16
        )
        for _ in range(2)
    ]
    g = torch.Generator().manual_seed(0)
    prompt = [0, 3, 70]  # empty, inside the sink, past windows and groups
    for cache in caches:
        ids = [cache.add_sequence() for _ in prompt]
    for cache in caches:
        torch.manual_seed(1)
        for layer in range(2):
            n = [p for p in prompt if p]
            x = torch.randn(sum(n), 2, 64)
            cache.append([i for i, p in zip(ids, prompt) if p], x, x * 2, n, layer=layer)
    for step in range(90):
        # a changing subset of the sequences, in a changing order
        rows = [ids[j] for j in torch.randperm(3, generator=g)[: 1 + step % 3].tolist()]
        for layer in range(2):
            k = torch.randn(len(rows), 2, 64, generator=g)
            v = torch.randn(len(rows), 2, 64, generator=g)
            caches[0].append(rows, k, v, layer=layer)
            with monkeypatch.context() as m:
                m.setattr(write, "write_decode_step", _general_writer)
                caches[1].append(rows, k, v, layer=layer)
        (a, sa, fa), (b, sb, fb) = _snapshot(caches[0]), _snapshot(caches[1])
        assert sa == sb and fa == fb
        for ta, tb in zip(a, b):
            assert torch.equal(ta, tb), f"step {step}"
    assert min(caches[0].seq_len(i) for i in ids) > 40  # windows and groups were crossed
