"""The fused decode-step write (foscar.kernels.cache_write, one Triton launch per role) against
the cache's torch writer, bit for bit: every pool, scale and window tensor after every step, for
both bit widths, every operand mapping, group sizes, windows, ragged batches, rotations, page
boundaries; and the cases it must refuse. Runs through the Triton interpreter on a CPU."""

import pytest
import torch
from conftest import KERNEL_DEVICE

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.backends import triton as triton_backend

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
    return [t.clone() for st in cache.layers for t in st.tensors().values()]


def _pair(fmt, head_dim, **kw):
    return [
        QuantizedKVCache(
            fmt,
            num_kv_heads=2,
            head_dim=head_dim,
            num_pages=48,
            max_seqs=4,
            num_layers=2,
            page_size=16,
            device=KERNEL_DEVICE,
            decode_write=path,
            **kw,
        )
        for path in ("torch", "fused")
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "K{}V{}-g{}-d{}-s{}w{}-{}".format(*c))
def test_fused_write_equals_torch_write(case, monkeypatch):
    kb, vb, g, d, sink, recent, mapping = case
    launches = []
    launch = triton_backend.write_decode_tokens
    monkeypatch.setattr(
        triton_backend, "write_decode_tokens", lambda *a: launches.append(a[2]) or launch(*a)
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
    for step in range(21):  # page size 16: every sequence crosses a page boundary
        for layer in range(2):
            # bf16 input on even steps (the model's dtype), fp32 on odd ones (rounded on entry);
            # outliers make groups with very different ranges
            dtype = torch.bfloat16 if step % 2 == 0 else torch.float32
            k = (torch.randn(3, 2, d, generator=gen) * torch.rand(1, 1, d, generator=gen) * 4).to(dtype)
            v = torch.randn(3, 2, d, generator=gen).to(dtype)
            v[0, 0, 0] = 30.0
            for c, cid in zip(caches, ids):
                c.append(cid, k.to(KERNEL_DEVICE), v.to(KERNEL_DEVICE), layer=layer)
        for a, b in zip(_snapshot(caches[0]), _snapshot(caches[1])):
            assert torch.equal(a, b), f"step {step}"
    assert caches[1].seq_len(ids[1][0]) == 21 and caches[1].seq_len(ids[1][2]) == 44
    assert launches == ["k", "v"] * 21 * 2  # the fused cache took the kernel at every step


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


def test_fused_write_refusals_leave_the_cache_unchanged():
    clipped = KVFormat(QuantFormat(2, "token", 64, clip=0.9), QuantFormat(2, "token", 64))
    channel = KVFormat(QuantFormat(2, "channel", 32), QuantFormat(2, "token", 64))
    for fmt, why in ((clipped, "clipped"), (channel, "channel-wise")):
        cache = _pair(fmt, 64)[1]
        sid = cache.add_sequence()
        x = torch.randn(41, 2, 64, device=KERNEL_DEVICE)
        cache.append([sid], x[:40], x[:40], [40])
        before, pages = _snapshot(cache), list(cache._free_pages)
        with pytest.raises(ValueError, match=f"decode_write='fused' cannot.*{why}"):
            cache.append([sid], x[40:], x[40:])
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(cache)))
        assert cache._free_pages == pages and cache.seq_len(sid) == 40
    # a per-layer clip (OSCAR's fitted ratios) refuses that layer only
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = _pair(fmt, 64)[1]
    cache.set_transform(1, value_clip=0.95)
    assert cache.fused_write_reason(0) is None
    assert "v history is clipped" in cache.fused_write_reason(1)
    with pytest.raises(ValueError, match="decode_write must be one of"):
        QuantizedKVCache(fmt, num_kv_heads=2, head_dim=64, num_pages=4, max_seqs=1, decode_write="x")


def test_auto_takes_the_torch_path_on_a_cpu():
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(2, "token", 64))
    cache = QuantizedKVCache(fmt, num_kv_heads=2, head_dim=64, num_pages=4, max_seqs=1)
    assert cache.decode_write == "auto" and not cache._fused_write(0)
