"""Shared prefixes in the serving core (PagedKV.adopt_prefix): a request that starts on a live
request's pages stores them once and decodes bit for bit as when it prefills every token itself;
ending (finishing, cancelling, preempting) one sharer leaves the others' outputs unchanged.
"""

from __future__ import annotations

import pytest
import torch

from foscar import KVFormat, QuantFormat
from foscar.serving import PagedKV, StepRow

HQ, H, D, LAYERS, BLOCK = 8, 4, 64, 2, 16
INT4 = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64), sink_tokens=4,
                recent_tokens=8)


def _paged():
    return PagedKV(INT4, num_layers=LAYERS, num_kv_heads=H, head_dim=D, num_blocks=24,
                   block_size=BLOCK, max_requests=3)


class Tokens:
    """Each request's K/V stream (BF16 values, ``[N, LAYERS, H, D]``) and a step runner that
    feeds ``kv`` a row's slice of it, with queries drawn per row from ``seed`` and the row's
    place (the same queries for the same decode row, however the prompt was written)."""

    def __init__(self, streams: dict, seed: int) -> None:
        self.streams = streams
        self.seed = seed

    def run(self, kv: PagedKV, rows) -> dict:
        """One step; returns each row's output per layer."""
        kv.begin_step(rows)
        q = torch.cat([
            torch.randn(r.query_length, HQ, D, generator=torch.Generator().manual_seed(
                self.seed * 100003 + r.past_length * 1009 + r.query_length))
            for r in rows
        ])
        out = {}
        for layer in range(LAYERS):
            k = torch.cat([self.streams[r.request_id][0][r.past_length:r.past_length
                                                         + r.query_length, layer] for r in rows])
            v = torch.cat([self.streams[r.request_id][1][r.past_length:r.past_length
                                                         + r.query_length, layer] for r in rows])
            o = kv.attend(layer, q, k, v, scaling=0.125)
            start = 0
            for r in rows:
                out.setdefault(r.request_id, []).append(o[start:start + r.query_length])
                start += r.query_length
        return out


def _stream(n, gen):
    return torch.randn(n, LAYERS, H, D, generator=gen).to(torch.bfloat16).float()


def _blocks(pages, own, length):
    """The engine's block table of a request holding ``pages`` first, then its ``own`` blocks,
    for ``length`` tokens."""
    table = list(pages) + [b for b in own if b not in pages]
    return tuple(table[: -(-length // BLOCK)])


@pytest.fixture
def streams():
    gen = torch.Generator().manual_seed(0)
    system = [_stream(70, gen) for _ in range(2)]  # a shared system prompt, K and V
    return {
        rid: tuple(torch.cat([s, _stream(50, gen)]) for s in system) for rid in ("a", "b", "c")
    }


def _prompt_then_decode(kv, tok, rid, prompt, blocks, steps, *, start=0):
    """Rows of ``rid``: its prompt from ``start`` (a prefill, or a chunk after adopted tokens),
    then ``steps`` decode steps; returns the decode outputs."""
    outs = [None]
    tok.run(kv, [StepRow(rid, start, prompt - start, blocks(prompt))])
    for i in range(steps):
        length = prompt + i
        outs.append(tok.run(kv, [StepRow(rid, length, 1, blocks(length + 1))])[rid])
    return outs[1:]


def test_sharers_store_the_prefix_once_and_decode_as_alone(streams):
    prompt = 90
    shared = _paged()
    tok = Tokens(streams, seed=1)
    a_blocks = (0, 1, 2, 3, 4, 5)
    _prompt_then_decode(shared, tok, "a", prompt, lambda n: a_blocks[: -(-n // BLOCK)], 2)
    outs = {}
    for rid, own in (("b", (6, 7, 8, 9, 10, 11)), ("c", (12, 13, 14, 15, 16, 17))):
        start = shared.adopt_prefix(rid, "a", 70, prompt)
        pages = shared.cache.pages_of(rid)
        assert start == 4 + 16 * len(pages) and len(pages) == 4  # 66 common history tokens
        outs[rid] = _prompt_then_decode(shared, Tokens(streams, seed=2), rid, prompt,
                                        lambda n, p=pages, o=own: _blocks(p, o, n), 5,
                                        start=start)
    # a holds 6 blocks (78 + 1 quantized tokens need 5, and a sixth block for its window); b and
    # c each hold 2 of their own beyond the 4 shared
    assert shared.cache.num_shared_pages == 4
    assert all(shared.cache.page_holders(p) == 3 for p in (0, 1, 2, 3))
    used = shared.cache.num_pages - shared.cache.num_free_pages
    for rid in ("b", "c"):
        alone = _paged()
        want = _prompt_then_decode(alone, Tokens(streams, seed=2), rid, prompt,
                                   lambda n: (6, 7, 8, 9, 10, 11)[: -(-n // BLOCK)], 5)
        assert used == 3 * len(alone.cache.pages_of(rid)) - 2 * 4
        for got, exp in zip(outs[rid], want, strict=True):
            for x, y in zip(got, exp, strict=True):
                assert torch.equal(x, y), rid


def test_ending_a_sharer_leaves_the_others_unchanged(streams):
    """b adopts a's pages; a is cancelled (released), then b is preempted and prefilled again
    from scratch while c, which adopted from b, decodes on: c's outputs equal its run alone."""
    prompt = 90
    kv = _paged()
    tok = Tokens(streams, seed=1)
    _prompt_then_decode(kv, tok, "a", prompt, lambda n: (0, 1, 2, 3, 4, 5)[: -(-n // BLOCK)], 1)
    start = kv.adopt_prefix("b", "a", 70, prompt)
    b_pages = kv.cache.pages_of("b")
    _prompt_then_decode(kv, tok, "b", prompt, lambda n: _blocks(b_pages, (6, 7), n), 1,
                        start=start)
    kv.release("a")  # cancelled: the pages b shares stay held
    assert not any(kv.cache.page_is_free(p) for p in b_pages)
    assert all(kv.cache.page_is_free(p) for p in (4, 5))
    start = kv.adopt_prefix("c", "b", 70, prompt)
    c_pages = kv.cache.pages_of("c")
    assert c_pages == b_pages
    c_tok = Tokens(streams, seed=5)
    c_blocks = (lambda n: _blocks(c_pages, (12, 13), n))
    c_tok.run(kv, [StepRow("c", start, prompt - start, c_blocks(prompt))])
    kv.release("b")  # preempted: the engine prefills it again later, from nothing
    got = []
    for i in range(4):
        length = prompt + i
        rows = [StepRow("c", length, 1, c_blocks(length + 1))]
        if i == 1:
            rows.append(StepRow("b", 0, prompt, (16, 17, 18, 19, 20, 21)))
        got.append(c_tok.run(kv, rows)["c"])
    assert kv.cache.num_shared_pages == 0
    alone = _paged()
    want = _prompt_then_decode(alone, Tokens(streams, seed=5), "c", prompt,
                               lambda n: (6, 7, 8, 9, 10, 11)[: -(-n // BLOCK)], 4)
    for g, w in zip(got, want, strict=True):
        for x, y in zip(g, w, strict=True):
            assert torch.equal(x, y)


def test_adopt_prefix_refusals(streams):
    kv = _paged()
    tok = Tokens(streams, seed=1)
    with pytest.raises(ValueError, match="not a live request"):
        kv.adopt_prefix("b", "a", 70, 90)
    _prompt_then_decode(kv, tok, "a", 30, lambda n: (0, 1)[: -(-n // BLOCK)], 0)
    with pytest.raises(ValueError, match="request_id itself"):
        kv.adopt_prefix("a", "a", 30, 30)
    # a 30-token donor has quantized 18 tokens: one full page; a 20-token prompt keeps its own
    # window: nothing to share, the request starts empty
    assert kv.adopt_prefix("b", "a", 30, 20) == 0 and "b" not in kv.live_requests
    assert kv.adopt_prefix("b", "a", 30, 90) == 20 and kv.cache.pages_of("b") == [0]
