"""Per-request sampling in the continuous-batching engine (:mod:`foscar.serving.sampling`).

The sampler against the distribution it must draw from (softmax of ``logits / T`` over the
top-k, then top-p tokens), with many keys on fixed logits; then in the engine on a small random
Llama: a seed gives the same answer alone and beside other requests, another seed another
answer, temperature 0 and top_k 1 the greedy one.
"""

from __future__ import annotations

import pytest
import torch

from foscar.serving.sampling import RequestSampler, gumbel_noise, sampling_key

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
DRAWS = 6000


def _draw(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
          min_p: float = 0.0, draws: int = DRAWS) -> torch.Tensor:
    """Tokens drawn for ``draws`` rows of ``logits``, each with its own key."""
    sampler = RequestSampler()
    lines = sampler.processors()
    scores = logits.expand(draws, -1).clone()
    args = {"temperature": torch.full((draws,), temperature).view(torch.int32),
            "top_k": torch.full((draws,), top_k, dtype=torch.int32),
            "top_p": torch.full((draws,), top_p).view(torch.int32),
            "min_p": torch.full((draws,), min_p).view(torch.int32)}
    for line in lines[1:-1]:
        scores = line(scores, args[line.name])
    keys = torch.tensor([sampling_key(7, p) for p in range(draws)], dtype=torch.int32)
    out = sampler(scores, keys)
    assert torch.isfinite(out).sum(-1).eq(1).all() and out.max(-1).values.eq(0).all()
    return out.argmax(-1)


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_draws_follow_the_softmax_at_the_temperature(temperature):
    freq = _frequencies(_draw(LOGITS, temperature=temperature), LOGITS.numel())
    expected = (LOGITS.double() / temperature).softmax(-1)
    # 6000 draws: a share's standard error is at most 0.0065
    assert torch.allclose(freq, expected, atol=0.025), (freq, expected)


def test_top_k_and_top_p_keep_the_leading_tokens_renormalized():
    freq = _frequencies(_draw(LOGITS, temperature=1.0, top_k=2), LOGITS.numel())
    expected = torch.zeros(LOGITS.numel(), dtype=torch.float64)
    expected[:2] = LOGITS[:2].double().softmax(-1)
    assert freq[2:].sum() == 0 and torch.allclose(freq, expected, atol=0.025)

    probs = LOGITS.double().softmax(-1)  # 0.43, 0.26, 0.16, ...: top_p 0.6 keeps two tokens
    assert probs[0] < 0.6 < probs[:2].sum()
    freq = _frequencies(_draw(LOGITS, temperature=1.0, top_p=0.6), LOGITS.numel())
    assert freq[2:].sum() == 0 and torch.allclose(freq, expected, atol=0.025)
    # a top_p below the first token's share keeps that token only
    assert _draw(LOGITS, temperature=1.0, top_p=0.1, draws=200).eq(0).all()


def test_greedy_rows_pass_unchanged_beside_sampled_ones():
    sampler = RequestSampler()
    lines = sampler.processors()
    scores = torch.randn(3, 50)
    args = {"temperature": torch.tensor([0.0, 1.0, 0.0]).view(torch.int32),
            "top_k": torch.zeros(3, dtype=torch.int32),
            "top_p": torch.ones(3).view(torch.int32),
            "min_p": torch.zeros(3).view(torch.int32)}
    for line in lines[1:-1]:
        line(scores, args[line.name])
    out = sampler(scores.clone(), torch.tensor([1, 2, 3], dtype=torch.int32))
    assert torch.equal(out[[0, 2]], scores[[0, 2]])
    assert torch.isfinite(out[1]).sum() == 1


def test_the_noise_is_a_function_of_key_and_token():
    ids = torch.arange(1000).expand(2, -1)
    a = gumbel_noise(torch.tensor([5, -9], dtype=torch.int32), ids)
    b = gumbel_noise(torch.tensor([5, -9], dtype=torch.int32), ids.flip(-1)).flip(-1)
    assert torch.equal(a, b) and not torch.equal(a[0], a[1]) and torch.isfinite(a).all()
    # Gumbel(0, 1): mean 0.5772, variance pi^2 / 6
    assert abs(a.mean().item() - 0.5772) < 0.1 and abs(a.var().item() - 1.645) < 0.2
    assert sampling_key(1, 0) != sampling_key(1, 1) != sampling_key(2, 1)
    assert -(2**31) <= sampling_key(-(2**70), 3) < 2**31


def test_min_p_keeps_the_tokens_near_the_leader():
    probs = LOGITS.double().softmax(-1)  # 0.43, 0.26, 0.16, 0.06, ...
    # min_p 0.3: a token stays at >= 0.13, three of them
    kept = (probs >= 0.3 * probs[0]).sum().item()
    assert kept == 3
    freq = _frequencies(_draw(LOGITS, temperature=1.0, min_p=0.3), LOGITS.numel())
    expected = torch.zeros(LOGITS.numel(), dtype=torch.float64)
    expected[:kept] = LOGITS[:kept].double().softmax(-1)
    assert freq[kept:].sum() == 0 and torch.allclose(freq, expected, atol=0.025)


def _reference_penalties(scores, prompt, answer, repetition, frequency, presence):
    """One row at a time, as transformers' and OpenAI's documentation state the rules."""
    out = scores.clone()
    for token in set(prompt) | set(answer):
        value = out[token]
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(answer):
        out[token] -= frequency * answer.count(token) + presence
    return out


def test_penalties_match_the_rules_row_by_row():
    from foscar.serving.sampling import apply_penalties

    torch.manual_seed(0)
    vocab = 37
    scores = torch.randn(3, vocab) * 3
    rows = [([1, 2, 3], [4, 4, 5], 1.3, 0.5, 0.25), ([], [7, 7, 7, 1], 1.0, -0.4, 1.5),
            ([0, 36], [], 0.8, 2.0, -2.0)]
    history = torch.zeros(3, vocab, dtype=torch.bool)
    counts = torch.zeros(3, vocab, dtype=torch.int32)
    for i, (prompt, answer, *_) in enumerate(rows):
        history[i, prompt + answer] = True
        counts[i] = torch.bincount(torch.tensor(answer, dtype=torch.int64), minlength=vocab)
    got = apply_penalties(scores, history, counts,
                          repetition=torch.tensor([r[2] for r in rows]),
                          frequency=torch.tensor([r[3] for r in rows]),
                          presence=torch.tensor([r[4] for r in rows]))
    for i, row in enumerate(rows):
        assert torch.allclose(got[i], _reference_penalties(scores[i], *row), atol=1e-6)


class _State:
    def __init__(self, request_id, prompt, answer, **kwargs):
        self.request_id = request_id
        self.initial_tokens, self.generated_tokens = prompt, answer
        self.logit_processor_kwargs = kwargs


class _Row:
    def __init__(self, state):
        self.state = state


def test_logit_bias_penalties_and_logprobs_through_the_processors():
    """The adjuster and the sampler on a batch of three greedy rows: a bias, a penalty and
    an untouched row; the two asking rows get the model's log-probabilities of the token the
    engine's argmax picks, with their alternatives."""
    torch.manual_seed(1)
    vocab = 11
    scores = torch.randn(3, vocab)
    states = [_State("a", [1], [2], logit_bias={5: 100.0}, logprobs=3),
              _State("b", [1], [], repetition_penalty=1.0, presence_penalty=0.0),
              _State("c", [3], [int(scores[2].argmax())], frequency_penalty=50.0, logprobs=0)]
    sampler = RequestSampler()
    lines = sampler.processors()
    for state in states[::2]:
        sampler.sink.watch(state.request_id)
    adjuster = lines[0]
    adjuster.prepare_tensor_args([_Row(s) for s in states])
    out = adjuster(scores.clone(), torch.zeros(3, dtype=torch.int32))
    zeros = {"temperature": torch.zeros(3).view(torch.int32),
             "top_k": torch.zeros(3, dtype=torch.int32),
             "top_p": torch.ones(3).view(torch.int32), "min_p": torch.zeros(3).view(torch.int32)}
    for line in lines[1:-1]:
        out = line(out, zeros[line.name])
    out = sampler(out, torch.zeros(3, dtype=torch.int32))
    picked = out.argmax(-1)
    assert picked[0] == 5 and torch.equal(out[1], scores[1])
    assert picked[2] != scores[2].argmax()  # the answer's token, penalized away
    raw = scores.log_softmax(-1)
    (a,), (c,) = sampler.sink.forget("a"), sampler.sink.forget("c")
    assert a.token == 5 and abs(a.logprob - raw[0, 5].item()) < 1e-6
    top_lp, top_ids = raw[0].topk(3)
    assert [t for t, _ in a.top] == top_ids.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in a.top]), top_lp)
    assert c.token == picked[2] and c.top == () and abs(c.logprob - raw[2, c.token]) < 1e-6
    assert len(sampler.sink) == 0


# ---------------------------------------------------------------------------- in the engine
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def llama(sampling_llama):
    return sampling_llama


def _answers(model, kv: str, requests: list[dict]) -> list[list[int]]:
    from foscar.serving import build_manager
    from foscar.serving.sampling import enable_sampling

    manager = build_manager(model, kv, num_blocks=32, block_size=16, max_new_tokens=12)
    enable_sampling(manager)
    manager.start()
    try:
        ids = [manager.add_request(PROMPT, **kw) for kw in requests]
        done = {}
        while len(done) < len(ids):
            out = manager.get_result(timeout=60)
            assert out is not None and out.error is None
            if out.is_finished():
                done[out.request_id] = out.generated_tokens
    finally:
        manager.stop(block=True)
    return [done[i] for i in ids]


@pytest.mark.parametrize("kv", ["bf16", "int4"])
def test_a_seed_gives_its_answer_whatever_runs_beside_it(llama, kv):
    hot = {"temperature": 1.0}
    greedy, zero, one, one_again, two, top1, nucleus = _answers(llama, kv, [
        {}, {"temperature": 0.0}, {**hot, "seed": 1}, {**hot, "seed": 1}, {**hot, "seed": 2},
        {**hot, "seed": 1, "top_k": 1}, {"temperature": 0.8, "top_p": 0.9, "seed": 3},
    ])
    (alone,) = _answers(llama, kv, [{**hot, "seed": 1}])
    assert zero == greedy and top1 == greedy
    assert one == one_again == alone
    assert one != two and one != greedy and nucleus != greedy  # 12 draws of a near-flat model


def test_enable_sampling_refuses_what_it_cannot_serve(llama):
    from foscar.serving import build_manager
    from foscar.serving.sampling import enable_sampling

    with pytest.raises(ValueError, match="ContinuousBatchingManager"):
        enable_sampling(object())
    with pytest.raises(ValueError, match="do_sample=True"):
        enable_sampling(build_manager(llama, "bf16", num_blocks=8, block_size=16,
                                      do_sample=True))
    manager = build_manager(llama, "bf16", num_blocks=8, block_size=16)
    enable_sampling(manager)
    required = manager.logit_processor.tensors_required
    enable_sampling(manager)  # again: nothing changes
    assert manager.logit_processor.tensors_required == required


def test_penalties_and_logprobs_in_the_engine(llama):
    """A strong presence penalty keeps an answer from repeating a token; logprobs arrive for
    every answer token, and the greedy token is the likeliest one."""
    from foscar.serving import build_manager
    from foscar.serving.sampling import enable_sampling, request_sampler

    manager = build_manager(llama, "int4", num_blocks=32, block_size=16, max_new_tokens=10)
    enable_sampling(manager)
    sink = request_sampler(manager).sink
    manager.start()
    try:
        sink.watch("lp")
        manager.add_request(PROMPT, request_id="lp", logprobs=2)
        manager.add_request(PROMPT, request_id="pen", presence_penalty=2.0,
                            frequency_penalty=2.0)
        done = {}
        while len(done) < 2:
            out = manager.get_result(timeout=60)
            assert out is not None and out.error is None
            if out.is_finished():
                done[out.request_id] = out.generated_tokens
    finally:
        manager.stop(block=True)
    entries = sink.forget("lp")
    assert [e.token for e in entries] == done["lp"]
    assert all(e.top[0][0] == e.token and e.logprob <= 0 for e in entries)
    assert len(set(done["pen"])) == len(done["pen"])
