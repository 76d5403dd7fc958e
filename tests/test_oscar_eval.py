"""OSCAR's ``foscar eval`` rows on a tiny random Llama: the row list and the rotated cache."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="foscar eval needs transformers (foscar[hf])")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from foscar.eval.metrics import decode_nll, make_cache, record_prefill  # noqa: E402
from foscar.eval.oscar_rows import OscarEvalFormat, make_oscar_cache, oscar_formats  # noqa: E402
from foscar.integrations.transformers import use_foscar_attention  # noqa: E402
from foscar.oscar import calibrate, fit_clips  # noqa: E402
from foscar.oscar.rotation import hadamard  # noqa: E402

D = 32


def _tiny_llama(head_dim):
    """A 2-layer Llama (4 query heads over 2 KV heads of ``head_dim``) and two 48-token
    calibration sequences."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=4 * head_dim,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    return model, [torch.randint(0, 96, (48,), generator=g) for _ in range(2)]


@pytest.fixture(scope="module")
def setup():
    model, seqs = _tiny_llama(D)
    cal = calibrate(model, seqs)
    rot = fit_clips(model, seqs[:1], cal.rotations(), num_queries=8)
    return model, cal, rot


def test_rows_from_a_calibration(setup):
    model, cal, rot = setup
    rows = oscar_formats(D, calibration=cal, rotations=rot, windows=(4, 16))
    names = [r.name for r in rows]
    assert names == [
        "INT2 Hadamard (QuaRot-style, clips 0.96/0.92)",
        "OSCAR INT2 (fitted clips)",
        "OSCAR INT2 + BF16 4/16 (fitted clips)",
        "OSCAR INT2 + BF16 4/16 (clips 0.96/0.92)",
        "OSCAR INT2 + BF16 4/16 w/o P_br (clips 0.96/0.92)",
        "OSCAR INT2 + BF16 4/16 w/o H (clips 0.96/0.92)",
        "OSCAR INT2 + BF16 4/16 w/o U (clips 0.96/0.92)",
        "OSCAR INT2 + BF16 4/16 no rotation (clips 0.96/0.92)",
        "OSCAR INT2 + BF16 4/16 K^TK/V^TV (clips 0.96/0.92)",
        "OSCAR INT4 (fitted clips)",
        "OSCAR INT4 + BF16 4/16 (fitted clips)",
    ]
    by = {r.name: r for r in rows}
    torch.testing.assert_close(by[names[0]].rotations.key[0, 0], hadamard(D))
    assert by[names[0]].fmt.key.clip == 0.96 and by[names[0]].fmt.value.clip == 0.92
    assert by[names[2]].clip_bits == 2 and by[names[2]].fmt.sink_tokens == 4
    assert by[names[3]].clip_bits is None and by[names[3]].rotations is rot
    assert by[names[7]].rotations.header["recipe"] == "none"
    assert by[names[8]].rotations.header["key_target"] == "plain"
    assert by[names[-1]].clip_bits == 4 and by[names[-1]].bits == 4
    assert all(r.fmt.key.group_size == D and r.fmt.key.axis.value == "token" for r in rows)
    # from a saved artifact without fitted clips: fixed ratios for INT2, min-max for INT4
    sel = oscar_formats(D, calibration=cal, rotations=rot, selected=rot, windows=(4, 16))
    assert [r.name for r in sel][3:5] == [
        "OSCAR-select INT2 (fitted clips)",
        "OSCAR-select INT2 + BF16 4/16 (fitted clips)",
    ]
    assert sel[4].clip_bits == 2 and sel[4].fmt.recent_tokens == 16
    held = [torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))]
    head = fit_clips(model, held, cal.rotations(per_head=True), num_queries=8)
    both = oscar_formats(
        D, calibration=cal, rotations=rot, selected=rot, selected_per_head=head, windows=(4, 16)
    )
    assert [r.name for r in both][3:7] == [
        "OSCAR-select INT2 (fitted clips)",
        "OSCAR-select INT2 + BF16 4/16 (fitted clips)",
        "OSCAR-select per-KV-head INT2 (fitted clips)",
        "OSCAR-select per-KV-head INT2 + BF16 4/16 (fitted clips)",
    ]
    assert both[6].rotations is head and both[6].clip_bits == 2 and both[6].fmt.sink_tokens == 4
    # --formats "OSCAR-select INT2 +" keeps selecting the per-layer row alone
    assert [r.name for r in both if "OSCAR-select INT2 +" in r.name] == [both[4].name]
    bare = cal.rotations()
    names = [r.name for r in oscar_formats(D, rotations=bare)]
    assert names == [
        "OSCAR INT2 (clips 0.96/0.92)",
        "OSCAR INT2 + BF16 64/256 (clips 0.96/0.92)",
        "OSCAR INT4 (min-max)",
        "OSCAR INT4 + BF16 64/256 (min-max)",
    ]
    with pytest.raises(ValueError, match="pass a calibration or rotations"):
        oscar_formats(D)
    with pytest.raises(ValueError, match="pass the fitted full rotations"):
        oscar_formats(D, calibration=cal)


@torch.no_grad()
def test_rotated_cache_in_the_harness(setup):
    """An OSCAR row's cache holds the prefill and decodes: rotated BF16 windows give the BF16
    NLL (to bf16 rounding), and the INT2 row's cache is rotated and re-clipped per layer."""
    model, cal, rot = setup
    use_foscar_attention(model)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (40, 30)]
    targets = torch.randint(0, 96, (2, 4), generator=g)
    inputs = torch.cat([torch.tensor([[r[-1]] for r in rows]), targets[:, :-1]], 1)
    pre = record_prefill(model, [r[:-1] for r in rows])
    windowed = [r for r in oscar_formats(D, calibration=cal, rotations=rot, windows=(0, 64))]
    bf16 = windowed[2]  # every token inside the recent window: only the rotation acts
    nll_rot = decode_nll(model, make_oscar_cache(model, bf16, pre, 8), pre, inputs, targets)
    nll_ref = decode_nll(model, make_cache(model, bf16.fmt, pre, 8), pre, inputs, targets)
    torch.testing.assert_close(nll_rot, nll_ref, atol=2e-2, rtol=2e-2)
    row = oscar_formats(D, calibration=cal, rotations=rot)[1]
    assert isinstance(row, OscarEvalFormat) and row.clip_bits == 2
    cache = row.make_cache(model, pre, 8)  # the harness's row interface
    tr = cache.kv.transforms[1]
    torch.testing.assert_close(tr.key_rotation[0], rot.key[1, 0])
    assert tr.key_clip == float(rot.clips[(2, "key")][1])
    assert cache.stored_lengths(0) == [39, 29]


def test_attention_errors(setup):
    from foscar.eval.oscar_rows import attention_errors

    model, cal, _ = setup
    g = torch.Generator().manual_seed(2)
    held = [torch.randint(0, 96, (40,), generator=g)]
    variants = {"full": ("full", {}), "none": ("none", {})}
    errs = attention_errors(
        model, cal, held, candidates=(1.0, 0.9), num_queries=8, variants=variants
    )
    assert set(errs) == {"full", "none"}
    for e in errs.values():
        for role in ("key", "value"):
            assert set(e[role]) == {"1", "0.9", "per-layer best"}
            assert 0 < e[role]["per-layer best"] <= min(e[role]["1"], e[role]["0.9"]) + 1e-12


@torch.no_grad()
def test_per_kv_head_selection_in_the_harness(setup):
    """The per-KV-head OSCAR-select row's cache holds one rotation per KV head per layer."""
    model, cal, rot = setup
    from foscar.oscar import choose_rotations

    held = [torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(4))]
    fitted = {
        "full": fit_clips(model, held, cal.rotations(), num_queries=8),
        "full-kvh": fit_clips(model, held, cal.rotations(per_head=True), num_queries=8),
    }
    sel = choose_rotations(fitted)
    row = oscar_formats(D, calibration=cal, rotations=rot, selected_per_head=sel)[4]
    assert row.name == "OSCAR-select per-KV-head INT2 + BF16 64/256 (fitted clips)"
    use_foscar_attention(model)
    g = torch.Generator().manual_seed(5)
    pre = record_prefill(model, [torch.randint(0, 96, (30,), generator=g).tolist()])
    cache = row.make_cache(model, pre, 8)
    for layer in range(2):
        tr = cache.kv.transforms[layer]
        for h in range(2):
            torch.testing.assert_close(tr.key_rotation[h], sel.key[layer, h])
            torch.testing.assert_close(tr.value_rotation[h], sel.value[layer, h])
        assert tr.value_clip == float(sel.clips[(2, "value")][layer])


@pytest.fixture(scope="module")
def setup64():
    """A tiny Llama with SmolLM2's head_dim 64 (groups of 32 split each head row in two)."""
    model, seqs = _tiny_llama(64)
    return model, seqs, calibrate(model, seqs)


@torch.no_grad()
def test_select_rows_with_groups_of_32(setup64):
    """OSCAR-select at g = 32: every candidate's clips are fitted with two groups per row, the
    rows quantize K and V in groups of 32 with those clips, and their cache holds them."""
    from foscar.eval.oscar_rows import select_candidates, select_formats

    model, seqs, cal = setup64
    kw = {"windows": (4, 8), "bits": (2,)}
    fitted, sel, kvh = select_candidates(model, seqs[:1], cal, group_size=32, **kw)
    assert {r.header["clip_fit"]["group_size"] for r in fitted.values()} == {32}
    assert kvh.per_head and not sel.per_head
    # two scales per row fit better than one: the min-max (p = 1) error of every candidate is
    # lower at g = 32 than at g = 64 (nested groups)
    at64, _, _ = select_candidates(model, seqs[:1], cal, **kw)
    for name, r in fitted.items():
        assert at64[name].header["clip_fit"]["group_size"] == 64
        for role in ("key", "value"):
            e32 = r.header["clip_fit"][f"int2.{role}"]["mean_relative_error"][0]
            e64 = at64[name].header["clip_fit"][f"int2.{role}"]["mean_relative_error"][0]
            assert e32 < e64, (name, role)
    rows = select_formats(64, sel, kvh, windows=(4, 8), group_size=32)
    assert [r.name for r in rows] == [
        "OSCAR-select INT2 g32 (fitted clips)",
        "OSCAR-select INT2 g32 + BF16 4/8 (fitted clips)",
        "OSCAR-select per-KV-head INT2 g32 (fitted clips)",
        "OSCAR-select per-KV-head INT2 g32 + BF16 4/8 (fitted clips)",
    ]
    for r in rows:
        assert (r.fmt.key.group_size, r.fmt.value.group_size, r.clip_bits) == (32, 32, 2)
        assert r.fmt.key.axis.value == "token" and r.fmt.key.bits == 2
    assert rows[1].rotations is sel and rows[3].rotations is kvh and rows[3].fmt.sink_tokens == 4
    # --formats "OSCAR-select INT2 +" keeps selecting the head-row rows only
    assert not [r for r in rows if "OSCAR-select INT2 +" in r.name]
    # the default group size keeps the unnamed rows, and refuses clips fitted at another size
    _, sel64, _ = select_candidates(model, seqs[:1], cal, **kw)
    assert select_formats(64, sel64)[1].name == "OSCAR-select INT2 + BF16 64/256 (fitted clips)"
    with pytest.raises(ValueError, match=r"fitted at group size \[32\], the rows quantize groups "):
        select_formats(64, sel, windows=(4, 8))
    with pytest.raises(ValueError, match=r"fitted at group size \[64\]"):
        select_formats(64, sel64, group_size=32)
    with pytest.raises(ValueError, match="group.group_size must be one of"):
        select_formats(64, sel, group_size=16)
    # the row's cache: groups of 32, the layer's rotation and its g = 32 clip
    use_foscar_attention(model)
    pre = record_prefill(model, [seqs[1][:30].tolist()])
    cache = rows[1].make_cache(model, pre, 8)
    assert cache.kv.fmt.key.group_size == 32 and cache.kv.fmt.value.group_size == 32
    for layer in range(2):
        tr = cache.kv.transforms[layer]
        torch.testing.assert_close(tr.key_rotation[0], sel.key[layer, 0])
        assert tr.key_clip == float(sel.clips[(2, "key")][layer])
        assert tr.value_clip == float(sel.clips[(2, "value")][layer])


def test_report_counts_the_selection():
    from foscar.eval.oscar_rows import report

    info = {
        "selection": {"key": ["ktk", "no-u", "ktk"], "value": ["full", "full", "ktk"]},
        "selection_per_kv_head": {
            "key": ["ktk-kvh", "no-u", "ktk"],
            "value": ["full-kvh", "full", "full-kvh"],
        },
        "selection_errors": {"key": {"full": 0.2, "ktk-kvh": 0.1}},
    }
    info["groups"] = {"32": {"selection": {"key": ["no-u", "no-u", "full"]}}}
    lines = report(info).splitlines()
    assert "- groups of 32: OSCAR-select key, of 3 layers: U*H*P_br in 1, H*P_br in 2" in lines
    assert "- OSCAR-select key, of 3 layers: H*P_br in 1, K^TK/V^TV in 2" in lines
    assert "- OSCAR-select value, of 3 layers: U*H*P_br in 2, K^TK/V^TV in 1" in lines
    assert (
        "- per-KV-head key, of 3 layers: H*P_br in 1, K^TK/V^TV in 1, K^TK/V^TV per KV head in 1"
        in lines
    )
    assert "- per-KV-head value, of 3 layers: U*H*P_br in 1, U*H*P_br per KV head in 2" in lines
    assert any(
        line.startswith("- fitted INT2 key error per candidate")
        and line.endswith("U*H*P_br 0.200, K^TK/V^TV per KV head 0.100")
        for line in lines
    )
    # the GPTQ choice's lines, keyed by "<row> + <keys>" and, in older results, by the row
    # alone
    from foscar.eval.oscar_rows import GPTQ_METRICS, GPTQ_SELECT

    chosen = {"selection_per_kv_head": {"key": ["no-u", "no-u", "ktk"]}}
    want = "- keys rounded by GPTQ: per-KV-head key, of 3 layers: H*P_br in 2, K^TK/V^TV in 1"
    for key in (f"{GPTQ_SELECT} + {GPTQ_METRICS['query']}", GPTQ_SELECT):
        assert want in report({"gptq": {key: chosen}}).splitlines()
    attention = report({"gptq": {f"{GPTQ_SELECT} + {GPTQ_METRICS['attention']}": chosen}})
    assert "- keys rounded by GPTQ under the attention-weighted metric: per-KV-head key" in (
        attention
    )
