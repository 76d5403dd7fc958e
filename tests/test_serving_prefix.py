"""Prefix sharing in transformers' continuous batching (``build_manager(...,
prefix_sharing=True)``) on a random Llama: requests sharing a system prompt store its pages once
and answer token for token as FoscarCache does with the same history layout (the adopted tokens
quantized when the rest of the prompt is prefilled); the same short trace without sharing gives
the same answers; ending one sharer (cancelled, or preempted and prefilled again) leaves the
others' answers unchanged.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import serve_requests, tiny_llama

from foscar import KVFormat, QuantFormat
from foscar.serving import build_manager

pytest.importorskip("transformers.generation.continuous_batching")

#: no windows: the adopted pages are what the request's own first chunk would find quantized,
#: so FoscarCache with the same chunks gives the same tokens bit for bit
INT4_BARE = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64))
INT4 = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64), sink_tokens=4,
                recent_tokens=8)
BLOCK = 16
NEW = 6
ENGINE = dict(block_size=BLOCK, max_batch_tokens=256, max_requests=4)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(layers=2, q_heads=4, kv_heads=2, head_dim=64)


def _prompts():
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 96, (70,), generator=gen).tolist()
    return [system + torch.randint(3, 96, (n,), generator=gen).tolist() for n in (9, 14, 5)]


@torch.no_grad()
def _reference(model, fmt, prompt, max_new, chunks):
    """Greedy tokens through FoscarCache, the prompt in ``chunks`` forward passes."""
    from foscar.integrations.transformers import FoscarCache, cache_kwarg, use_foscar_attention

    original = model.config._attn_implementation
    use_foscar_attention(model)
    try:
        cache = FoscarCache(fmt, model.config, max_cache_len=len(prompt) + max_new, page_size=BLOCK)
        kw = {cache_kwarg(model): cache}
        ids, pos = torch.tensor([prompt]), 0
        for c in chunks:
            out = model(input_ids=ids[:, pos : pos + c], use_cache=True, **kw)
            pos += c
        tokens = []
        for _ in range(max_new):
            t = int(out.logits[0, -1].argmax())
            tokens.append(t)
            out = model(input_ids=torch.tensor([[t]]), use_cache=True, **kw)
        return tokens
    finally:
        model.set_attn_implementation(original)


def _serve(model, fmt, prompts, *, sharing, new=NEW, **kw):
    manager = build_manager(model, fmt, prefix_sharing=sharing, eos_token_id=-1,
                            **{**ENGINE, "num_blocks": 64, **kw})
    outs = serve_requests(manager, [(p, {"max_new_tokens": new}) for p in prompts],
                          staggered=True)
    return manager, [o.generated_tokens for o in outs]


def test_sharers_store_the_system_prompt_once(llama):
    prompts = _prompts()
    manager, got = _serve(llama, INT4_BARE, prompts, sharing=True)
    cache = manager.cache
    # the first request prefills all 70 system tokens; the others adopt its 4 full pages
    assert cache.shared_tokens == 2 * 64
    unshared, alone = _serve(llama, INT4_BARE, prompts, sharing=False)
    assert unshared.cache.shared_tokens == 0
    # the requests overlap: the shared run holds fewer pages at its peak
    assert cache.paged.peak_pages < unshared.cache.paged.peak_pages
    for i, (prompt, tokens) in enumerate(zip(prompts, got)):
        chunks = [len(prompt)] if i == 0 else [64, len(prompt) - 64]
        assert tokens == _reference(llama, INT4_BARE, prompt, NEW, chunks), i
    assert got == alone
    paged = cache.paged
    assert paged.live_requests == () and paged.cache.num_free_pages == paged.cache.num_pages


def test_windowed_format_answers_as_without_sharing(llama):
    prompts = _prompts()
    manager, got = _serve(llama, INT4, prompts, sharing=True)
    # 70 system tokens: sink 4, then the full pages before each adopter's own window: 4 pages
    # for the 84-token prompt (72 quantized), 3 for the 75-token one (63 quantized)
    assert manager.cache.shared_tokens == (4 + 64) + (4 + 48)
    _, alone = _serve(llama, INT4, prompts, sharing=False)
    assert got == alone


def test_preempted_sharer_leaves_the_others_unchanged(llama):
    """A pool too small for every request at once: the engine preempts sharers (their hold on
    the shared pages ends; each is prefilled again later, adopting again where it can); every
    answer equals the same trace's in a pool large enough for all, and each adopter's equals
    FoscarCache's with its prompt in the same two chunks."""
    prompts = _prompts() + [_prompts()[0][:70] + [7, 8, 9]]
    manager, got = _serve(llama, INT4_BARE, prompts, sharing=True, new=20, num_blocks=9)
    paged = manager.cache.paged
    assert paged.restarts, "the pool was meant to run out and preempt a request"
    roomy, want = _serve(llama, INT4_BARE, prompts, sharing=True, new=20)
    assert not roomy.cache.paged.restarts
    assert got == want
    for prompt, tokens in zip(prompts[1:], got[1:]):
        assert tokens == _reference(llama, INT4_BARE, prompt, 20, [64, len(prompt) - 64])
    assert paged.live_requests == () and paged.cache.num_free_pages == paged.cache.num_pages


def test_cancelled_donor_leaves_the_sharers_unchanged(llama):
    prompts = _prompts()
    manager = build_manager(llama, INT4_BARE, num_blocks=64, prefix_sharing=True,
                            eos_token_id=-1, **ENGINE)
    manager.start()
    try:
        donor = manager.add_request(prompts[0], max_new_tokens=150)
        deadline = time.monotonic() + 300
        while not manager.cache or donor not in manager.cache.paged.live_requests:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ids = [manager.add_request(p, max_new_tokens=NEW) for p in prompts[1:]]
        while manager.cache.shared_tokens < 2 * 64:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        manager.cancel_request(donor)
        done = {}
        while len(done) < len(ids):
            assert time.monotonic() < deadline
            r = manager.get_result(timeout=1)
            if r is not None and r.request_id in ids and r.is_finished():
                done[r.request_id] = r.generated_tokens
    finally:
        manager.stop(block=True)
    _, alone = _serve(llama, INT4_BARE, prompts, sharing=False)
    assert [done[i] for i in ids] == alone[1:]
    paged = manager.cache.paged
    assert paged.live_requests == () and paged.cache.num_free_pages == paged.cache.num_pages


def test_engine_without_the_block_ledger_is_refused(llama, monkeypatch):
    from foscar.serving import continuous

    monkeypatch.delattr(continuous.PagedAttentionCache, "count_new_complete_blocks")
    with pytest.raises(ValueError, match="prefix_sharing=True needs the block ledger"):
        build_manager(llama, INT4, prefix_sharing=True, **{**ENGINE, "num_blocks": 64})
    build_manager(llama, "bf16", prefix_sharing=True, num_blocks=64)  # the engine's own setting
