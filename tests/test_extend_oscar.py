"""OSCAR layers on the extend path: the rotations go on the query, the chunk and the output (per
chunk token), not undone over the dequantized history in float64; the greedy tokens of a
chunked prefill on SmolLM2 are those of undoing them over the history."""

import math

import torch
from kernel_cases import rel_l2

from foscar import KVFormat, QuantFormat, QuantizedKVCache
from foscar.backends import extend
from foscar.backends.extend import attend_chunk

HEAD_DIM = 64


def _orthogonal(shape, gen):
    return torch.linalg.qr(torch.randn(*shape, HEAD_DIM, HEAD_DIM, generator=gen,
                                       dtype=torch.float64)).Q  # fmt: skip


def _undo_over_history(q, k, v, cache, batch, row, sm_scale, new_mask):
    """The path before: the history's rotations undone in float64 (model coordinates)."""
    o = attend_chunk(cache, batch, row, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                     sm_scale, new_mask)  # fmt: skip
    return o.transpose(0, 1).to(q.dtype)


def test_torch_path_rotates_query_and_output_not_history():
    gen = torch.Generator().manual_seed(0)
    fmt = KVFormat(QuantFormat(2, "token", 64), QuantFormat(4, "token", 64), sink_tokens=4,
                   recent_tokens=8)  # fmt: skip
    cache = QuantizedKVCache(fmt, num_kv_heads=2, head_dim=HEAD_DIM, num_pages=8, max_seqs=1,
                             page_size=16)  # fmt: skip
    cache.set_transform(0, key_rotation=_orthogonal((2,), gen),
                        value_rotation=_orthogonal((2,), gen))  # fmt: skip
    seq = cache.add_sequence()
    cache.append([seq], torch.randn(70, 2, HEAD_DIM, generator=gen),
                 torch.randn(70, 2, HEAD_DIM, generator=gen), [70])  # fmt: skip
    batch = cache.plan([seq])
    q = torch.randn(9, 6, HEAD_DIM, generator=gen)
    k, v = torch.randn(2, 9, 2, HEAD_DIM, generator=gen)
    before = _undo_over_history(q, k, v, cache, batch, 0, 0.125, None)
    calls = []
    original = cache.transforms[0].rotate

    def counting(x, role, **kw):
        calls.append(x.shape[0])
        return original(x, role, **kw)

    object.__setattr__(cache.transforms[0], "rotate", counting)
    now = extend.extend_attention(q, k, v, cache, batch, 0, 0.125, path="torch")
    assert rel_l2(now, before) < 1e-5  # fp32 rotations of the chunk against float64 of the past
    assert calls == [9, 9, 9, 9]  # q, k, v and the output: chunk rows only
    assert math.isfinite(float(now.sum()))


def test_chunked_prefill_oscar_tokens_equal_undoing_over_history(smollm2, monkeypatch):
    """SmolLM2 with random per-KV-head rotations (every layer, INT2 with BF16 windows, the
    README recipe's shape at small windows): a prompt prefilled in chunks of 8 gives the same
    greedy tokens whether the extend path rotates the query and output or undoes the rotations
    over the history."""
    from foscar.integrations.transformers import cache_kwarg, use_foscar_attention
    from foscar.oscar import OscarRotations, oscar_cache

    model, tok = smollm2
    chunk = 8
    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    gen = torch.Generator().manual_seed(7)
    int2 = QuantFormat(2, "token", 64)
    fmt = KVFormat(int2, int2, sink_tokens=4, recent_tokens=8)
    rk, rv = _orthogonal((layers, kv_heads), gen), _orthogonal((layers, kv_heads), gen)
    prompt = tok("A long sentence about the sea and the moon at night, written by a poet who "
                 "lived near the harbour and knew every boat and sailor:")["input_ids"]
    assert len(prompt) > 2 * chunk

    rotations = OscarRotations(rk, rv)

    @torch.no_grad()
    def greedy(new=8):
        cache = oscar_cache(fmt, cfg, rotations, max_cache_len=len(prompt) + new, page_size=16)
        kw = {cache_kwarg(model): cache}
        ids = torch.tensor([prompt])
        for pos in range(0, len(prompt), chunk):
            out = model(input_ids=ids[:, pos : pos + chunk], use_cache=True, **kw)
        tokens = []
        for _ in range(new):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([tokens[-1:]]), use_cache=True, **kw)
        return tokens

    original = model.config._attn_implementation
    use_foscar_attention(model)
    try:
        now = greedy()
        monkeypatch.setattr(extend, "_torch_path", _undo_over_history)
        before = greedy()
    finally:
        model.set_attn_implementation(original)
    assert now == before
