"""Per-layer widths for a bit budget (:func:`foscar.oscar.widths_by_budget`) on a tiny random
Llama's fitted errors: within the budget, and maximal along the ranking of error per bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="OSCAR's calibration runs a transformers model")

from conftest import tiny_llama  # noqa: E402

from foscar import KVFormat, QuantFormat, effective_bits  # noqa: E402
from foscar.oscar import (  # noqa: E402
    OscarRotations,
    budget_bounds,
    calibrate,
    fit_clips,
    layer_width_formats,
    layers_by_gain,
    widths_by_budget,
)

LAYERS, CONTEXT = 4, 4096
INT2 = QuantFormat(2, "token", 32)
FMT = KVFormat(INT2, INT2, sink_tokens=64, recent_tokens=256)


@pytest.fixture(scope="module")
def fitted():
    """Rotations of a 4-layer random Llama with INT2 and INT4 clips fitted (and their
    per-layer errors recorded)."""
    model = tiny_llama(layers=LAYERS, q_heads=4, kv_heads=2, head_dim=32)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (48, 40)]
    with torch.no_grad():
        rot = calibrate(model, seqs).rotations()
        return fit_clips(model, seqs[:1], rot, bits=(2, 4), num_queries=8, windows=(4, 8))


def bits_of(key_bits, value_bits) -> float:
    return effective_bits(CONTEXT, layer_width_formats(FMT, key_bits=key_bits,
                                                       value_bits=value_bits))


def gains(rot, role):
    table = rot.header["clip_fit"]
    e2, e4 = (torch.tensor(table[f"int{b}.{role}"]["fitted_relative_error"]) for b in (2, 4))
    return (e2.square() - e4.square()).tolist()


def test_widths_meet_the_budget_and_are_maximal(fitted):
    floor, ceiling = budget_bounds(FMT, CONTEXT)
    assert floor == pytest.approx(bits_of([2] * LAYERS, [2] * LAYERS))
    assert ceiling == pytest.approx(bits_of([4] * LAYERS, [4] * LAYERS))
    step = (ceiling - floor) / (2 * LAYERS)  # each INT4 layer of K or V adds the same
    # the walk: keys and values in one order by the fall of their fitted error
    order = sorted(
        ((-g, layer, r, role) for r, role in enumerate(("key", "value"))
         for layer, g in enumerate(gains(fitted, role)))
    )  # fmt: skip
    for role in ("key", "value"):  # within a role, widths_by_error's ranking
        assert [o[1] for o in order if o[3] == role] == layers_by_gain(fitted, role=role)
    for n_wide in range(2 * LAYERS + 1):
        budget = floor + (n_wide + 0.5) * step if n_wide < 2 * LAYERS else ceiling
        key_bits, value_bits = widths_by_budget(fitted, FMT, budget, CONTEXT)
        achieved = bits_of(key_bits, value_bits)
        assert achieved <= budget
        widths = {"key": key_bits, "value": value_bits}
        wide = {(role, layer) for role in widths for layer in range(LAYERS)
                if widths[role][layer] == 4}
        assert wide == {(role, layer) for _, layer, _, role in order[:n_wide]}, budget
        if n_wide < 2 * LAYERS:  # maximal: the next of the order would exceed the budget
            _, layer, _, role = order[n_wide]
            widths[role][layer] = 4
            assert bits_of(widths["key"], widths["value"]) > budget
    # at the floor INT2 everywhere; at or above INT4 everywhere every layer INT4
    assert widths_by_budget(fitted, FMT, floor, CONTEXT) == ([2] * LAYERS, [2] * LAYERS)
    assert widths_by_budget(fitted, FMT, 16.0, CONTEXT) == ([4] * LAYERS, [4] * LAYERS)


def test_keys_and_values_compete_on_one_measure(fitted):
    """Set errors: the walk interleaves the roles by their error falls, equal costs tying to
    the earlier layer, keys first."""
    errors = {"key": [0.5, 0.1, 0.3, 0.2], "value": [0.4, 0.1, 0.25, 0.15]}
    fit = {f"int{b}.{role}": {"fitted_relative_error": e if b == 2 else [0.0] * LAYERS}
           for role, e in errors.items() for b in (2, 4)}  # fmt: skip
    rot = OscarRotations(fitted.key, fitted.value, dict(fitted.clips), {"clip_fit": fit})
    floor, ceiling = budget_bounds(FMT, CONTEXT)
    step = (ceiling - floor) / (2 * LAYERS)
    # by falls: k0 .25, v0 .16, k2 .09, v2 .0625, k3 .04, v3 .0225, k1 .01 = v1 .01
    expected = [([2, 2, 2, 2], [2, 2, 2, 2]), ([4, 2, 2, 2], [2, 2, 2, 2]),
                ([4, 2, 2, 2], [4, 2, 2, 2]), ([4, 2, 4, 2], [4, 2, 2, 2]),
                ([4, 2, 4, 2], [4, 2, 4, 2]), ([4, 2, 4, 4], [4, 2, 4, 2]),
                ([4, 2, 4, 4], [4, 2, 4, 4]), ([4, 4, 4, 4], [4, 2, 4, 4])]  # fmt: skip
    for n_wide, widths in enumerate(expected):
        assert widths_by_budget(rot, FMT, floor + (n_wide + 0.5) * step, CONTEXT) == widths


def test_a_budget_below_int2_everywhere_is_refused(fitted):
    floor, _ = budget_bounds(FMT, CONTEXT)
    with pytest.raises(ValueError, match="bits=.* is below INT2 everywhere"):
        widths_by_budget(fitted, FMT, floor - 0.01, CONTEXT)
    with pytest.raises(ValueError, match="bits must be a number > 0"):
        widths_by_budget(fitted, FMT, 0, CONTEXT)
