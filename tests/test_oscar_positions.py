"""RoPE shifts: calibration statistics at the positions a served context spans, from short
sequences (``foscar.oscar.positions``), checked against the model run at those positions."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="calibration runs a transformers model")

from conftest import tiny_llama  # noqa: E402

from foscar.oscar import calibrate, fit_clips  # noqa: E402
from foscar.oscar.calibrate import attention_key_metrics  # noqa: E402
from foscar.oscar.capture import capture_attention  # noqa: E402
from foscar.oscar.positions import (  # noqa: E402
    check_shifts,
    position_shifts,
    rope_shifter,
    shifted_views,
)

LAYERS, HQ, H, D = 2, 4, 2, 32
DELTA = 700  # far past the 40-token sequences: RoPE's fast pairs turn many times


@pytest.fixture(scope="module")
def tiny():
    # slow pairs that 40 positions barely turn, as a long context has
    return tiny_llama(
        layers=LAYERS,
        q_heads=HQ,
        kv_heads=H,
        head_dim=D,
        max_position_embeddings=1024,
        rope_theta=500.0,
    )


class AtPositions:
    """``model`` fed with positions ``delta .. delta + T - 1`` instead of ``0 .. T - 1``: what
    a shift must reproduce (the causal mask does not read the positions)."""

    def __init__(self, model, delta: int):
        self._model, self._delta = model, delta

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *, input_ids, **kw):
        t = input_ids.shape[1]
        positions = torch.arange(self._delta, self._delta + t)[None]
        return self._model(input_ids=input_ids, position_ids=positions, **kw)


def sequences(lengths=(40, 31), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g) for n in lengths]


@torch.no_grad()
def captured(model, seqs):
    out = []
    with capture_attention(model, lambda *a: out.append(a)):
        for s in seqs:
            model(input_ids=s[None], use_cache=False)
    return out


def test_position_shifts_cover_the_context():
    assert position_shifts(2048, 8192) == (0, 2048, 4096, 6144)
    assert position_shifts(2048, 5000) == (0, 2048, 2952)  # the last copy ends at 4999
    assert position_shifts(2048, 2049) == (0, 1)
    for context in (None, 1, 2048):
        assert position_shifts(2048, context) == (0,)
    # more copies than max_shifts: max_shifts of them, spread evenly, first and last kept
    assert position_shifts(1000, 41000, max_shifts=5) == (0, 10000, 20000, 30000, 40000)
    assert position_shifts(1000, 41000, max_shifts=1) == (0,)
    assert len(position_shifts(128, 131072)) == 8
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="context must be None or an int >= 1"):
            position_shifts(2048, bad)
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"):
        position_shifts(0, 100)
    with pytest.raises(ValueError, match="max_shifts must be an int >= 1"):
        position_shifts(10, 100, max_shifts=0)


def test_check_shifts_names_the_expected_value():
    assert check_shifts([0, 5]) == (0, 5)
    for bad in ((), (0, 0), (-1,), (1.5,), (True,)):
        with pytest.raises(ValueError, match="position_shifts must be distinct ints >= 0"):
            check_shifts(bad)


def test_a_shift_is_the_model_at_later_positions(tiny):
    """Shifted q and k of a sequence equal what the model computes at positions shifted by
    the same amount (float32 RoPE in both), V is untouched (exactly in the first layer; later
    layers read the float32 rounding of the one before), and every score q . k is kept."""
    s = sequences((40,))
    shift = rope_shifter(tiny)
    here, there = captured(tiny, s), captured(AtPositions(tiny, DELTA), s)
    for (layer, q, k, v, _), (_, q2, k2, v2, _) in zip(here, there):
        torch.testing.assert_close(shift(q, DELTA), q2, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(shift(k, DELTA), k2, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v, v2, atol=0 if layer == 0 else 1e-6, rtol=0)
        assert not torch.allclose(q, q2, atol=1e-2)  # the shift moved the vectors
        g = HQ // H
        kk = k.repeat_interleave(g, 0).double()
        scores = q.double() @ kk.transpose(1, 2)
        moved = shift(q, DELTA).double() @ shift(k, DELTA).double().repeat_interleave(g, 0).mT
        torch.testing.assert_close(moved, scores, atol=1e-4, rtol=1e-5)
    assert shift(q, 0) is q


def test_shift_of_a_partial_rotary_model_leaves_the_other_channels():
    """With RoPE on the first channels only (a partial rotary factor) the rest stay."""

    class FakeRotaryEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.tensor([1.0, 0.1, 0.01, 0.001]))

    model = torch.nn.Sequential(FakeRotaryEmbedding())
    shift = rope_shifter(model)
    x = torch.randn(2, 5, 12)
    y = shift(x, 3)
    torch.testing.assert_close(y[..., 8:], x[..., 8:], atol=0, rtol=0)
    angle = torch.tensor([3.0, 0.3, 0.03, 0.003])
    # channel i pairs with i + 4 (rotate_half over the 8 turned channels)
    a, b = x[..., :4], x[..., 4:8]
    torch.testing.assert_close(y[..., :4], a * angle.cos() - b * angle.sin())
    torch.testing.assert_close(y[..., 4:8], b * angle.cos() + a * angle.sin())
    with pytest.raises(ValueError, match="RoPE turns 8 channels; x has 6"):
        shift(torch.randn(1, 2, 6), 1)
    with pytest.raises(ValueError, match="x must be \\[heads, tokens, head_dim\\]"):
        shift(torch.randn(2, 6), 1)


def test_a_model_with_two_ropes_of_different_frequencies_is_refused():
    class FakeRotaryEmbedding(torch.nn.Module):
        def __init__(self, theta):
            super().__init__()
            self.register_buffer("inv_freq", theta ** -torch.arange(0, 1, 0.25))

    rope_shifter(torch.nn.Sequential(FakeRotaryEmbedding(1e4), FakeRotaryEmbedding(1e4)))
    with pytest.raises(ValueError, match="rotary embeddings of different frequencies"):
        rope_shifter(torch.nn.Sequential(FakeRotaryEmbedding(1e4), FakeRotaryEmbedding(1e6)))


def test_a_model_without_rope_is_refused_unless_nothing_is_shifted():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="position shifts need a RoPE model"):
        rope_shifter(model)
    q, k = torch.randn(4, 3, 8), torch.randn(2, 3, 8)
    assert shifted_views(model, (0,))(q, k) == [(q, k)]
    with pytest.raises(ValueError, match="position shifts need a RoPE model"):
        shifted_views(model, (0, 1))


@torch.no_grad()
def test_calibration_with_shifts_is_the_calibration_at_those_positions(tiny):
    """The key targets of shifts (0, delta) are the mean of the targets taken with the model
    at positions 0.. and delta..; the value targets do not move."""
    seqs = sequences()
    at_0 = calibrate(tiny, seqs, proxy=True)
    at_delta = calibrate(AtPositions(tiny, DELTA), seqs, proxy=True)
    only_delta = calibrate(tiny, seqs, proxy=True, position_shifts=(DELTA,))
    both = calibrate(tiny, seqs, proxy=True, position_shifts=(0, DELTA))
    assert both.header["position_shifts"] == [0, DELTA]
    assert at_0.header["position_shifts"] == [0]
    for layer in range(LAYERS):

        def target(cal, name, layer=layer):
            return cal.target(layer, name, per_head=True)

        for name in ("key", "kk"):
            a, b = target(at_0, name), target(at_delta, name)
            assert not torch.allclose(a, b, rtol=1e-2)
            torch.testing.assert_close(target(only_delta, name), b, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(target(both, name), (a + b) / 2, rtol=1e-4, atol=1e-6)
        for name in ("value", "vv"):
            torch.testing.assert_close(target(both, name), target(at_0, name), rtol=0, atol=0)
        # the proxy weighs values by the keys' expected squared logit, at the shifted positions
        torch.testing.assert_close(
            target(only_delta, "proxy"), target(at_delta, "proxy"), rtol=1e-3, atol=1e-6
        )


@torch.no_grad()
def test_clip_fit_with_a_shift_fits_the_keys_at_those_positions(tiny):
    """fit_clips with the shift (delta,) measures what the model at positions delta.. gives;
    with (0, delta) the keys' errors add over both, the values' are taken once."""
    seqs = sequences((60, 47))
    cal = calibrate(tiny, seqs)

    def fit(model, shifts=(0,)):
        rot = cal.rotations("full", per_head=True)
        fit_clips(
            model, seqs, rot, bits=(2,), num_queries=8, windows=(2, 8), position_shifts=shifts
        )
        return rot.header["clip_fit"]["int2.key"], rot.header["clip_fit"]["int2.value"], rot

    k0, v0, _ = fit(tiny)
    kd, vd, _ = fit(AtPositions(tiny, DELTA))
    ks, vs, rot = fit(tiny, (DELTA,))
    kb, vb, _ = fit(tiny, (0, DELTA))
    assert rot.header["clip_fit"]["position_shifts"] == [DELTA]
    # the same errors to float32 rounding (a code at a rounding boundary may flip)
    for a, b in ((ks, kd), (vs, vd)):
        torch.testing.assert_close(
            torch.tensor(a["mean_relative_error"]), torch.tensor(b["mean_relative_error"]),
            rtol=2e-3, atol=1e-6,
        )  # fmt: skip
    assert k0["mean_relative_error"] != kd["mean_relative_error"]  # the positions matter
    # values: no shift changes them, so (0, delta) reads them once, as (0,) does
    assert vb["mean_relative_error"] == v0["mean_relative_error"]
    # keys: (0, delta) lies between the two positions' errors, layer by layer and candidate
    lo = torch.minimum(
        torch.tensor(k0["mean_relative_error"]), torch.tensor(kd["mean_relative_error"])
    )
    hi = torch.maximum(
        torch.tensor(k0["mean_relative_error"]), torch.tensor(kd["mean_relative_error"])
    )
    both = torch.tensor(kb["mean_relative_error"])
    assert bool((both >= lo * (1 - 1e-3)).all() and (both <= hi * (1 + 1e-3)).all())


@torch.no_grad()
def test_attention_key_metric_with_a_shift(tiny):
    seqs = sequences((60, 47))
    m_delta = attention_key_metrics(AtPositions(tiny, DELTA), seqs, windows=(2, 8))
    m_shift = attention_key_metrics(tiny, seqs, windows=(2, 8), position_shifts=(DELTA,))
    m_0 = attention_key_metrics(tiny, seqs, windows=(2, 8))
    torch.testing.assert_close(m_shift, m_delta, rtol=1e-3, atol=1e-6)
    assert not torch.allclose(m_0, m_delta, rtol=1e-2)
