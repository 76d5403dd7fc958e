"""OSCAR calibration on a tiny random Llama: capture, targets, rotations, clips, files."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers", reason="calibration runs a transformers model")
pytest.importorskip("safetensors", reason="rotations are saved as safetensors")

from conftest import tiny_llama  # noqa: E402
from transformers import DynamicCache, LlamaConfig  # noqa: E402

from foscar import KVFormat, QuantFormat, QuantizedKVCache  # noqa: E402
from foscar.integrations.transformers import cache_kwarg  # noqa: E402
from foscar.oscar import (  # noqa: E402
    FORMAT_VERSION,
    OscarRotations,
    apply_to_cache,
    calibrate,
    fit_clips,
)
from foscar.oscar.capture import capture_attention  # noqa: E402
from foscar.oscar.rotation import hadamard  # noqa: E402

f64 = torch.float64
LAYERS, HQ, H, D = 2, 4, 2, 32


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(layers=LAYERS, q_heads=HQ, kv_heads=H, head_dim=D)


def sequences(lengths=(40, 23), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g) for n in lengths]


def captured(model, seqs):
    """Every layer's (q, k, v, scaling) per sequence, by the capture hook."""
    out = []
    with capture_attention(model, lambda *a: out.append(a)), torch.no_grad():
        for s in seqs:
            model(input_ids=s[None], use_cache=False)
    return out


@torch.no_grad()
def test_capture_sees_what_the_cache_stores(tiny):
    """The captured K/V are the post-RoPE K/V a KV cache receives; Q is rotated alike."""
    s = sequences((30,))[0]
    cap = captured(tiny, [s])
    assert [c[0] for c in cap] == [0, 1]
    cache = DynamicCache()
    tiny(input_ids=s[None], use_cache=True, **{cache_kwarg(tiny): cache})
    for layer, q, k, v, scaling in cap:
        assert q.shape == (HQ, 30, D) and k.shape == (H, 30, D)
        torch.testing.assert_close(k, cache.layers[layer].keys[0], atol=0, rtol=0)
        torch.testing.assert_close(v, cache.layers[layer].values[0], atol=0, rtol=0)
        assert scaling == pytest.approx(1 / math.sqrt(D))
    assert tiny.config._attn_implementation != "foscar_oscar_capture"  # restored


@torch.no_grad()
def test_targets_equal_their_definitions_over_the_sequences(tiny):
    seqs = sequences()
    cal = calibrate(tiny, seqs, proxy=True, dtype=f64)
    assert cal.num_layers == LAYERS and cal.header["calibration_tokens"] == 63
    proxy = cal.rotations(value_target="proxy")
    assert proxy.header["value_target"] == "proxy" and proxy.value.shape == (LAYERS, 1, D, D)
    cap = captured(tiny, seqs)
    for layer in range(LAYERS):
        rows = [c for c in cap if c[0] == layer]
        cq = torch.zeros(H, D, D, dtype=f64)
        cs = torch.zeros(H, D, D, dtype=f64)
        n = 0
        for _, q, k, v, scaling in rows:
            t = k.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            q, k, v = q.double(), k.double(), v.double()
            for j in range(HQ):
                h = j // (HQ // H)
                cq[h] += q[j].T @ q[j]
                s = torch.softmax((q[j] @ k[h].T * scaling).masked_fill(~causal, -math.inf), -1)
                cs[h] += (s @ v[h]).T @ (s @ v[h])
            n += t * HQ // H
        torch.testing.assert_close(
            cal.target(layer, "key", per_head=True), cq / n, rtol=1e-6, atol=0
        )
        torch.testing.assert_close(
            cal.target(layer, "value", per_head=True), cs / n, rtol=1e-6, atol=0
        )
        # per-layer targets average the heads
        torch.testing.assert_close(cal.target(layer, "key"), (cq / n).mean(0, keepdim=True))
        # the proxy pass used the final key target
        w = torch.cat(
            [
                torch.einsum("htd,hde,hte->ht", k.double(), cq / n, k.double())
                for *_, k, _v, _s in rows
            ],
            1,
        )  # noqa: E501
        vv = torch.cat([r[3].double() for r in rows], 1)
        want = torch.einsum("ht,htd,hte->hde", w, vv, vv) / w.sum(1)[:, None, None]
        torch.testing.assert_close(
            cal.target(layer, "proxy", per_head=True), want, rtol=1e-6, atol=0
        )


@torch.no_grad()
def test_rotations_from_a_calibration(tiny):
    cal = calibrate(tiny, sequences(), header={"model": "tiny"})
    r = cal.rotations()
    assert r.key.shape == (LAYERS, 1, D, D) and not r.per_head
    eye = torch.eye(D, dtype=f64)
    for m in (r.key, r.value):
        torch.testing.assert_close(m.transpose(-1, -2) @ m, eye.expand_as(m), atol=1e-12, rtol=0)
    assert r.header["model"] == "tiny" and r.header["recipe"] == "full"
    ph = cal.rotations("no-br", key_target="plain", value_target="plain", per_head=True)
    assert ph.key.shape == (LAYERS, H, D, D) and ph.per_head and ph.header["key_target"] == "plain"
    torch.testing.assert_close(cal.rotations("hadamard").value[1, 0], hadamard(D))
    with pytest.raises(ValueError, match="recipe must be one of"):
        cal.rotations("quarot")
    with pytest.raises(ValueError, match="key_target must be one of"):
        cal.rotations(key_target="keys")
    with pytest.raises(ValueError, match="value_target must be one of"):
        cal.rotations(value_target="scores")
    with pytest.raises(ValueError, match="proxy target has no data"):
        cal.rotations(value_target="proxy")


@torch.no_grad()
def test_fitted_clips_minimise_the_recorded_error(tiny):
    seqs = sequences()
    r = fit_clips(tiny, seqs, calibrate(tiny, seqs).rotations(), bits=(2,), num_queries=8)
    fit = r.header["clip_fit"]
    assert fit["group_size"] == D and fit["tokens"] == 63
    for role in ("key", "value"):
        clips = r.clips[(2, role)]
        assert clips.shape == (LAYERS,) and bool(((clips > 0) & (clips <= 1)).all())
        table = fit[f"int2.{role}"]
        assert table["fitted"] == clips.tolist() and len(table["fitted_relative_error"]) == LAYERS
        # the fitted mean error is at most that of any single ratio for every layer
        assert table["fitted_mean_relative_error"] <= min(table["mean_relative_error"]) + 1e-12
    with pytest.raises(ValueError, match="clip must be in"):
        fit_clips(tiny, seqs, r, candidates=(0.9, 1.5))


def test_save_load_round_trip_and_checks(tiny, tmp_path):
    seqs = sequences()
    cal = calibrate(tiny, seqs, header={"model": "tiny", "calibration_text": "random ids"})
    r = fit_clips(tiny, seqs[:1], cal.rotations(per_head=True), bits=(2,), num_queries=4)
    path = tmp_path / "oscar.safetensors"
    r.save(path)
    back = OscarRotations.load(path, num_layers=LAYERS, num_kv_heads=H, head_dim=D)
    assert torch.equal(back.key, r.key) and torch.equal(back.value, r.value)
    assert torch.equal(back.clips[(2, "key")], r.clips[(2, "key")])
    h = back.header
    assert h["version"] == FORMAT_VERSION and h["model"] == "tiny" and h["num_layers"] == LAYERS
    assert h["head_dim"] == D and h["calibration_text"] == "random ids"
    assert h["calibration_tokens"] == 63 and h["per_head"] is True
    with pytest.raises(ValueError, match="num_layers: the rotations have 2 layers"):
        OscarRotations.load(path, num_layers=3)
    with pytest.raises(ValueError, match="head_dim: the rotations are 32-dimensional"):
        OscarRotations.load(path, head_dim=64)
    with pytest.raises(ValueError, match="num_kv_heads: the per-head rotations have 2"):
        OscarRotations.load(path, num_kv_heads=4)
    with pytest.raises(ValueError, match="is not a file"):
        OscarRotations.load(tmp_path / "missing.safetensors")
    # a file of another version, or without the header, is refused
    from safetensors.torch import save_file

    bad = tmp_path / "v0.safetensors"
    save_file(
        {"key_rotation": r.key, "value_rotation": r.value},
        str(bad),
        metadata={"oscar": json.dumps({**h, "version": 0})},
    )
    with pytest.raises(ValueError, match="format version 0"):
        OscarRotations.load(bad)
    save_file({"key_rotation": r.key}, str(bad))
    with pytest.raises(ValueError, match="not an OSCAR rotations file"):
        OscarRotations.load(bad)


def test_artifact_rejects_inconsistent_tensors():
    eye = torch.eye(D, dtype=f64).expand(LAYERS, 1, D, D)
    with pytest.raises(ValueError, match="key must be a"):
        OscarRotations(torch.eye(D), eye)
    with pytest.raises(ValueError, match="differ in shape"):
        OscarRotations(eye, eye[:1])
    with pytest.raises(ValueError, match="one ratio per layer"):
        OscarRotations(eye, eye, {(2, "key"): torch.ones(3)})


def test_apply_to_cache(tiny):
    eye = torch.eye(D, dtype=f64).expand(LAYERS, 1, D, D)
    h = hadamard(D).expand(LAYERS, 1, D, D)
    r = OscarRotations(h, eye, {(2, "key"): torch.tensor([0.9, 0.8], dtype=f64)})
    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "token", 32))
    cache = QuantizedKVCache(
        fmt, num_kv_heads=H, head_dim=D, num_pages=4, max_seqs=1, num_layers=LAYERS
    )
    with pytest.raises(ValueError, match="clip_bits: no value clip ratios"):
        apply_to_cache(r, cache, clip_bits=2)
    r.clips[(2, "value")] = torch.tensor([1.0, 0.7], dtype=f64)
    apply_to_cache(r, cache, clip_bits=2)
    tr = cache.transforms[1]
    assert tr.value_rotation is None  # identity skipped
    torch.testing.assert_close(tr.key_rotation[1], hadamard(D))
    assert (tr.key_clip, tr.value_clip) == (0.8, 0.7)
    small = QuantizedKVCache(fmt, num_kv_heads=H, head_dim=D, num_pages=4, max_seqs=1)
    with pytest.raises(
        ValueError, match="num_layers: the rotations have 2 layers, the model has 1"
    ):
        apply_to_cache(r, small)


@torch.no_grad()
def test_transformers_cache_with_rotations(tiny):
    """Through a model: rotated BF16 windows match the unrotated cache (bf16 rounding apart),
    and rotated INT2 changes the logits (the rotations do act on the quantized history)."""
    from foscar.integrations.transformers import FoscarCache, use_foscar_attention
    from foscar.oscar import oscar_cache

    use_foscar_attention(tiny)
    seqs = sequences()
    rot = calibrate(tiny, seqs).rotations()
    ids = sequences((50,), seed=3)[0][None]
    kw = cache_kwarg(tiny)

    def logits(cache):
        tiny(input_ids=ids[:, :-5], **{kw: cache})
        tiny(input_ids=ids[:, -5:-4], **{kw: cache})  # a decode step over the cache
        # an extend step (3 tokens: the dequantized cache in model coordinates), then a decode
        tiny(input_ids=ids[:, -4:-1], **{kw: cache})
        return tiny(input_ids=ids[:, -1:], **{kw: cache}).logits[0, -1]

    window = KVFormat(QuantFormat(2, "token", D), QuantFormat(2, "token", D), recent_tokens=64)
    plain = logits(FoscarCache(window, tiny.config, max_cache_len=64))
    rotated = logits(oscar_cache(window, tiny.config, rot, max_cache_len=64))
    torch.testing.assert_close(rotated, plain, atol=2e-2, rtol=0)
    int2 = KVFormat(QuantFormat(2, "token", D), QuantFormat(2, "token", D))
    a = logits(FoscarCache(int2, tiny.config, max_cache_len=64))
    b = logits(oscar_cache(int2, tiny.config, rot, max_cache_len=64))
    assert (a - b).abs().max() > 1e-3
    with pytest.raises(ValueError, match="num_layers: the rotations have 2 layers"):
        big = LlamaConfig(**{**tiny.config.to_dict(), "num_hidden_layers": 3})
        oscar_cache(int2, big, rot)


def assert_picks_smallest_fitted_error(sel, cands, per_head=False):
    """For every layer and role, ``sel`` holds the candidate with the smallest fitted INT2
    error (broadcast to the KV heads when ``per_head``), with that candidate's fitted clips."""
    fits = sel.header["clip_fit"]
    for role in ("key", "value"):
        errs = {n: fits[n][f"int2.{role}"]["fitted_relative_error"] for n in cands}
        for layer in range(LAYERS):
            best = min(cands, key=lambda n: errs[n][layer])
            assert sel.header["selection"][role][layer] == best
            want = getattr(cands[best], role)[layer]
            if per_head:
                want = want.expand(H, D, D)  # from [1 or H, D, D]
            assert torch.equal(getattr(sel, role)[layer], want)
            for b in (2, 4):
                clip = float(sel.clips[(b, role)][layer])
                assert clip == fits[best][f"int{b}.{role}"]["fitted"][layer]
                assert clip == float(cands[best].clips[(b, role)][layer])
        per = sel.header["selection"][f"{role}_error_per_candidate"]
        assert sel.header["selection"][f"{role}_error"] <= min(per.values()) + 1e-12


@torch.no_grad()
def test_select_rotations_takes_the_better_candidate_per_layer(tiny):
    from foscar.oscar import select_rotations

    seqs = sequences()
    cal = calibrate(tiny, seqs)
    cands = {"full": cal.rotations(), "no-u": cal.rotations("no-u")}
    sel = select_rotations(tiny, seqs[:1], cands, bits=(2, 4), num_queries=8)
    assert_picks_smallest_fitted_error(sel, cands)
    with pytest.raises(ValueError, match="candidates must name at least one"):
        select_rotations(tiny, seqs, {})
    with pytest.raises(ValueError, match="select_bits"):
        select_rotations(tiny, seqs, cands, bits=(4,))
    short = OscarRotations(cal.rotations().key[:1], cal.rotations().value[:1])
    with pytest.raises(ValueError, match="candidates must share num_layers and head_dim"):
        select_rotations(tiny, seqs, {**cands, "short": short})


@torch.no_grad()
def test_select_rotations_with_per_kv_head_candidates(tiny):
    """Per-layer and per-KV-head candidates mix: per-layer ones are broadcast to the KV heads,
    the choice per layer and role is the smallest fitted error, and choosing among a subset of
    the fitted candidates equals selecting among that subset from scratch."""
    from foscar.oscar import choose_rotations, fit_candidates, select_rotations

    seqs = sequences()
    cal = calibrate(tiny, seqs)
    plain = {"key_target": "plain", "value_target": "plain"}

    def candidates():
        return {
            "full": cal.rotations(),
            "no-u": cal.rotations("no-u"),
            "full-kvh": cal.rotations(per_head=True),
            "ktk-kvh": cal.rotations(**plain, per_head=True),
        }

    cands = candidates()
    fitted = fit_candidates(tiny, seqs[:1], cands, bits=(2, 4), num_queries=8)
    assert fitted is cands and all((2, "key") in r.clips for r in cands.values())
    sel = choose_rotations(fitted)
    assert sel.per_head and tuple(sel.key.shape) == (LAYERS, H, D, D)
    assert sel.header["candidates"]["full-kvh"]["per_head"] is True
    assert sel.header["candidates"]["full"]["per_head"] is False
    assert_picks_smallest_fitted_error(sel, cands, per_head=True)
    # per KV head, U*H*P_br differs between the heads (each head's own targets)
    assert not torch.allclose(cands["full-kvh"].key[0, 0], cands["full-kvh"].key[0, 1])
    # a subset of the fitted candidates: the same as selecting among it from scratch; adding
    # the per-head candidates can only lower the fitted error
    layer_only = {n: r for n, r in fitted.items() if not r.per_head}
    sub = choose_rotations(layer_only)
    assert not sub.per_head and tuple(sub.key.shape) == (LAYERS, 1, D, D)
    fresh = {n: r for n, r in candidates().items() if n in layer_only}
    again = select_rotations(tiny, seqs[:1], fresh, bits=(2, 4), num_queries=8)
    assert again.header["selection"] == sub.header["selection"]
    assert torch.equal(again.key, sub.key) and torch.equal(again.value, sub.value)
    for role in ("key", "value"):
        e_all = sel.header["selection"][f"{role}_error"]
        assert e_all <= sub.header["selection"][f"{role}_error"] + 1e-12
    # the candidates were not modified by the choices
    torch.testing.assert_close(cands["full"].key, cal.rotations().key)
    # on a cache: one rotation per KV head, the broadcast layers included
    fmt = KVFormat(QuantFormat(2, "token", D), QuantFormat(2, "token", D))
    cache = QuantizedKVCache(
        fmt, num_kv_heads=H, head_dim=D, num_pages=4, max_seqs=1, num_layers=LAYERS
    )
    apply_to_cache(sel, cache, clip_bits=2)
    for layer in range(LAYERS):
        tr = cache.transforms[layer]
        torch.testing.assert_close(tr.key_rotation, sel.key[layer])
        torch.testing.assert_close(tr.value_rotation, sel.value[layer])
        assert tr.key_clip == float(sel.clips[(2, "key")][layer])


@torch.no_grad()
def test_choose_rotations_by_gptq_errors_carries_each_layers_factors(tiny):
    """Candidates whose keys are rounded by GPTQ: each layer's key rotation comes with its own
    candidate's GPTQ factors (the metric in that basis), the choice is made by the GPTQ key
    errors, and candidates with and without factors do not mix."""
    from foscar.oscar import choose_rotations, fit_candidates, gptq_factors

    seqs = sequences()
    cal = calibrate(tiny, seqs)

    def rounded(rot):
        return OscarRotations(rot.key, rot.value, {}, dict(rot.header), gptq_factors(cal, rot))

    cands = {"full": rounded(cal.rotations()), "no-u": rounded(cal.rotations("no-u"))}
    fit_candidates(tiny, seqs[:1], cands, bits=(2,), num_queries=8)
    sel = choose_rotations(cands)
    assert sel.key_gptq is not None and tuple(sel.key_gptq.shape) == (LAYERS, H, D, D)
    errors = {
        n: r.header["clip_fit"]["int2.key"]["fitted_relative_error"] for n, r in cands.items()
    }
    for layer, name in enumerate(sel.header["selection"]["key"]):
        assert errors[name][layer] == min(e[layer] for e in errors.values())
        assert torch.equal(sel.key[layer], cands[name].key[layer])
        assert torch.equal(sel.key_gptq[layer], cands[name].key_gptq[layer])
    # each layer's factors come from its own choice: force "full" in layer 0, "no-u" in 1
    for name, errs in (("full", [0.1, 0.9]), ("no-u", [0.9, 0.1])):
        cands[name].header["clip_fit"]["int2.key"]["fitted_relative_error"] = errs
    sel = choose_rotations(cands)
    assert sel.header["selection"]["key"] == ["full", "no-u"]
    assert not torch.equal(cands["full"].key_gptq[1], cands["no-u"].key_gptq[1])
    for layer, name in enumerate(["full", "no-u"]):
        assert torch.equal(sel.key[layer], cands[name].key[layer])
        assert torch.equal(sel.key_gptq[layer], cands[name].key_gptq[layer])
    plain = fit_clips(tiny, seqs[:1], cal.rotations(), bits=(2,), num_queries=8)
    with pytest.raises(ValueError, match=r"\['full'\] have GPTQ key factors and \['plain'\]"):
        choose_rotations({"full": cands["full"], "plain": plain})
    # without factors the result has none
    assert choose_rotations({"plain": plain}).key_gptq is None


def test_choose_rotations_checks_its_candidates(tiny):
    from foscar.oscar import choose_rotations

    cal = calibrate(tiny, sequences())
    with pytest.raises(ValueError, match="candidates must name at least one"):
        choose_rotations({})
    with pytest.raises(ValueError, match=r"candidates \['full'\] have no fitted clips"):
        choose_rotations({"full": cal.rotations()})
    fitted = fit_clips(tiny, sequences()[:1], cal.rotations(), bits=(4,), num_queries=8)
    with pytest.raises(ValueError, match=r"select_bits \(2\) must be one of bits \(4,\)"):
        choose_rotations({"full": fitted})
    eye = torch.eye(D, dtype=f64)
    three = OscarRotations(eye.expand(LAYERS, 3, D, D), eye.expand(LAYERS, 3, D, D))
    with pytest.raises(ValueError, match="per KV head of one count"):
        choose_rotations({"head": cal.rotations(per_head=True), "three": three})


def test_windowed_attention_reads_exact_keys_inside_the_windows():
    """The clip fit's attention with BF16 windows, against a per-query loop."""
    from foscar.oscar.calibrate import causal_attention, window_mask

    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 5, 8, dtype=f64, generator=g)
    k, v, kq, vq = (torch.randn(2, 20, 8, dtype=f64, generator=g) for _ in range(4))
    positions = torch.tensor([6, 10, 13, 17, 19])
    window = window_mask(positions, 20, (2, 3))
    out = causal_attention(q, k, v, positions, 0.5, kq=kq, vq=vq, window=window)
    for i, t in enumerate(positions.tolist()):
        exact = [j < 2 or j > t - 3 for j in range(t + 1)]
        ks = torch.stack([k[:, j] if e else kq[:, j] for j, e in enumerate(exact)], 1)
        vs = torch.stack([v[:, j] if e else vq[:, j] for j, e in enumerate(exact)], 1)
        for h in range(4):
            p = torch.softmax(q[h, i] @ ks[h // 2].T * 0.5, -1)
            torch.testing.assert_close(out[h, i], p @ vs[h // 2], atol=1e-12, rtol=0)
    assert window_mask(positions, 20, (0, 0)) is None
    assert window_mask(positions, 20, (3, 0))[:, :3].all()


@torch.no_grad()
def test_clip_fit_with_windows(tiny):
    seqs = sequences()
    cal = calibrate(tiny, seqs)
    # windows holding every token: nothing is quantized, every candidate would score zero and
    # the tie would pass min-max off as fitted clips: refused, naming the length needed
    for windows in ((64, 0), (0, 40), (20, 20)):
        with pytest.raises(ValueError, match=f"longer than sink \\+ recent = {sum(windows)}"):
            fit_clips(tiny, seqs[:1], cal.rotations(), bits=(2,), num_queries=4, windows=windows)
    # one key past the windows is enough to fit
    r = fit_clips(tiny, seqs[:1], cal.rotations(), bits=(2,), num_queries=4, windows=(20, 19))
    assert r.header["clip_fit"]["windows"] == [20, 19]
    assert max(r.header["clip_fit"]["int2.key"]["mean_relative_error"]) > 0
    r = fit_clips(tiny, seqs[:1], cal.rotations(), bits=(2,), num_queries=4, windows=(4, 8))
    assert min(r.header["clip_fit"]["int2.value"]["mean_relative_error"]) > 0
    with pytest.raises(ValueError, match="windows must be"):
        fit_clips(tiny, seqs, cal.rotations(), windows=(4, -1))


def test_gptq_factors_in_the_artifact_the_clip_fit_and_the_cache(tiny, tmp_path):
    """gptq_factors: per layer and KV head, GPTQ's factor of R^T C_Q R (the keys' metric in the
    stored basis); carried by OscarRotations through save/load into each layer's transform;
    fit_clips rounds the keys with it (so its key errors differ from rounding to nearest)."""
    from foscar.oscar import gptq_factors
    from foscar.quantize import gptq_factor

    seqs = sequences()
    cal = calibrate(tiny, seqs)
    rot = cal.rotations()
    factors = gptq_factors(cal, rot)
    assert factors.shape == (LAYERS, H, D, D) and factors.dtype == torch.float32
    r1 = rot.key[1, 0]
    want = gptq_factor(r1.T @ cal.target(1, "key", per_head=True)[1] @ r1)
    torch.testing.assert_close(factors[1, 1], want.float())
    rounded = OscarRotations(rot.key, rot.value, {}, dict(rot.header), factors)
    fit_clips(tiny, seqs[:1], rounded, bits=(2,), num_queries=8)
    fit_clips(tiny, seqs[:1], rot, bits=(2,), num_queries=8)
    ek = rounded.header["clip_fit"]["int2.key"]["mean_relative_error"]
    assert ek != rot.header["clip_fit"]["int2.key"]["mean_relative_error"]
    assert (
        rounded.header["clip_fit"]["int2.value"]["mean_relative_error"]
        == rot.header["clip_fit"]["int2.value"]["mean_relative_error"]
    )
    path = tmp_path / "gptq.safetensors"
    rounded.save(path)
    back = OscarRotations.load(path, num_layers=LAYERS, num_kv_heads=H, head_dim=D)
    assert torch.equal(back.key_gptq, factors)
    fmt = KVFormat(QuantFormat(2, "token", 32), QuantFormat(2, "token", 32))
    cache = QuantizedKVCache(
        fmt, num_kv_heads=H, head_dim=D, num_pages=4, max_seqs=1, num_layers=LAYERS
    )
    apply_to_cache(back, cache)
    assert torch.equal(cache.transforms[1].key_gptq, factors[1])
    with pytest.raises(ValueError, match=r"key_gptq must be \[num_layers=2"):
        OscarRotations(rot.key, rot.value, {}, {}, factors[:1])
    other = QuantizedKVCache(fmt, num_kv_heads=4, head_dim=D, num_pages=4, max_seqs=1, num_layers=2)
    with pytest.raises(ValueError, match="num_kv_heads: key_gptq has 2 heads"):
        apply_to_cache(back, other)


@torch.no_grad()
def test_attention_key_metric_equals_its_definition(tiny):
    """attention_key_metrics: per layer and KV head, sum_n w_n q_n^T q_n / sum_n w_n over the
    query heads of the KV head and every query_stride-th position n that reads a quantized key,
    w_n = sum_{i quantized} p_ni^2 |v_i - o_n|^2 (keys outside the windows), computed here with
    explicit loops in float64 from the captured Q, K, V; gptq_factors(metrics=...) factors it
    in the stored basis; bad windows and shapes are refused."""
    from foscar.oscar import attention_key_metrics, gptq_factors
    from foscar.quantize import gptq_factor

    seqs = sequences()
    sink, recent, stride = 3, 5, 2
    metrics = attention_key_metrics(tiny, seqs, windows=(sink, recent), query_stride=stride)
    assert metrics.shape == (LAYERS, H, D, D) and metrics.dtype == f64
    cap = captured(tiny, seqs)
    for layer in range(LAYERS):
        m = torch.zeros(H, D, D, dtype=f64)
        wsum = torch.zeros(H, dtype=f64)
        for _, q, k, v, scaling in (c for c in cap if c[0] == layer):
            q, k, v = q.double(), k.double(), v.double()
            for j in range(HQ):
                h = j // (HQ // H)
                for n in range(sink + recent, k.shape[1], stride):
                    p = torch.softmax(q[j, n] @ k[h, : n + 1].T * scaling, -1)
                    o = p @ v[h, : n + 1]
                    w = sum(
                        float(p[i]) ** 2 * float((v[h, i] - o).square().sum())
                        for i in range(sink, n + 1 - recent)
                    )
                    m[h] += w * torch.outer(q[j, n], q[j, n])
                    wsum[h] += w
        torch.testing.assert_close(metrics[layer], m / wsum[:, None, None], rtol=1e-4, atol=1e-6)
    cal = calibrate(tiny, seqs)
    rot = cal.rotations(per_head=True)
    factors = gptq_factors(cal, rot, metrics=metrics)
    r = rot.key[1, 0]
    want = gptq_factor(r.T @ metrics[1, 0] @ r)
    torch.testing.assert_close(factors[1, 0], want.float())
    assert not torch.allclose(factors, gptq_factors(cal, rot))  # another metric than C_Q
    with pytest.raises(ValueError, match=r"metrics must be \[num_layers=2, num_kv_heads=2"):
        gptq_factors(cal, rot, metrics=metrics[:1])
    with pytest.raises(ValueError, match="longer than sink \\+ recent = 40"):
        attention_key_metrics(tiny, seqs, windows=(8, 32))
    with pytest.raises(ValueError, match="query_stride must be an int >= 1"):
        attention_key_metrics(tiny, seqs, windows=(3, 5), query_stride=0)


def test_attention_key_moment_checks_its_masks():
    from foscar.oscar.covariance import attention_key_moment

    q, k = torch.randn(4, 3, 8), torch.randn(2, 5, 8)
    visible = torch.ones(3, 5, dtype=torch.bool).tril(2)
    with pytest.raises(ValueError, match=r"visible must be a \[n=3, T=5\] bool"):
        attention_key_moment(q, k, k, 1.0, visible[:, :4], visible)
    with pytest.raises(ValueError, match="quantized must be a subset of visible"):
        attention_key_moment(q, k, k, 1.0, visible, torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention_key_moment(q[:3], k, k, 1.0, visible, visible)
    # no quantized key: no weight at all
    m, w = attention_key_moment(q, k, k, 1.0, visible, torch.zeros(3, 5, dtype=torch.bool))
    assert float(w.abs().sum()) == 0 and float(m.abs().sum()) == 0


@torch.no_grad()
def test_fold_value_rotations_into_the_model(tiny):
    """fold_value_rotations: v_proj computes v R_V and o_proj takes o R_V^T back, so the model's
    output is unchanged (float64: to 1e-10) with per-layer and per-KV-head rotations; through a
    rotated INT2 cache, the folded model with the returned rotations (no value rotation left in
    the cache) decodes what the unfolded one does with the cache rotating the values."""
    import copy

    from foscar.oscar import fold_value_rotations, oscar_cache

    seqs = sequences()
    cal = calibrate(tiny, seqs)
    ids = sequences((50,), seed=3)[0][None]
    for per_head in (False, True):
        rot = cal.rotations(per_head=per_head)
        exact = copy.deepcopy(tiny).double()
        bias = exact.model.layers[0].self_attn.v_proj
        bias.bias = torch.nn.Parameter(torch.randn(bias.out_features, dtype=f64))  # a bias too
        want = exact(input_ids=ids).logits
        folded = fold_value_rotations(exact, rot)
        torch.testing.assert_close(exact(input_ids=ids).logits, want, atol=1e-10, rtol=0)
        assert folded.header["value_rotations_folded"] and torch.equal(folded.key, rot.key)
        assert bool((folded.value == torch.eye(D, dtype=f64)).all())
        with pytest.raises(ValueError, match="already folded"):
            fold_value_rotations(exact, folded)
    from foscar.integrations.transformers import use_foscar_attention

    rot = cal.rotations(per_head=True)
    tiny = copy.deepcopy(tiny)  # (the module's fixture keeps its attention implementation)
    model = copy.deepcopy(tiny)
    use_foscar_attention(model)
    use_foscar_attention(tiny)
    kw = cache_kwarg(tiny)
    int2 = KVFormat(QuantFormat(2, "token", D), QuantFormat(2, "token", D), sink_tokens=4)

    def logits(m, r):
        cache = oscar_cache(int2, m.config, r, max_cache_len=64)
        m(input_ids=ids[:, :-2], **{kw: cache})
        m(input_ids=ids[:, -2:-1], **{kw: cache})  # a decode step over the cache
        out = m(input_ids=ids[:, -1:], **{kw: cache}).logits[0, -1]
        return out, cache

    want, cache = logits(tiny, rot)
    assert cache.kv.transforms[0].value_rotation is not None
    got, cache = logits(model, fold_value_rotations(model, rot))
    assert cache.kv.transforms[0].value_rotation is None
    assert cache.kv.transforms[0].key_rotation is not None
    # a folded model refuses unfolded rotations and an unfolded one folded rotations
    with pytest.raises(ValueError, match="config says folded"):
        oscar_cache(int2, model.config, rot, max_cache_len=64)
    with pytest.raises(ValueError, match="config says not folded"):
        oscar_cache(int2, tiny.config, fold_value_rotations(copy.deepcopy(tiny), rot))
    with pytest.raises(ValueError, match="already folded into its weights"):
        fold_value_rotations(model, rot)
    unrotated, _ = logits(tiny, OscarRotations(rot.key, torch.eye(D, dtype=f64).expand(
        rot.value.shape).contiguous(), {}, {}))  # fmt: skip
    # (measured: 3.5e-5 against 0.13: one rounding of the weights, not another basis)
    assert (got - want).abs().max() < 0.01 * (unrotated - want).abs().max()
    with pytest.raises(ValueError, match="Llama-style attention modules"):
        fold_value_rotations(torch.nn.Linear(2, 2), rot)


@pytest.mark.gpu(reason="runs on the device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fold_value_rotations_on_a_gpu_model(tiny, dtype):
    """fold_value_rotations on a model whose weights live on the GPU, from rotations on the CPU
    (the rotation must move to the weights' device). The folded model's logits against
    the unfolded one's: the weights rounded once to ``dtype``."""
    import copy

    from foscar.oscar import fold_value_rotations

    rot = calibrate(tiny, sequences()).rotations(per_head=True)
    ids = sequences((40,), seed=5)[0][None].cuda()
    model = copy.deepcopy(tiny).to("cuda", dtype)
    v = model.model.layers[0].self_attn.v_proj
    v.bias = torch.nn.Parameter(torch.randn(v.out_features, device="cuda", dtype=dtype))
    want = model(input_ids=ids).logits.float()
    fold_value_rotations(model, rot)
    got = model(input_ids=ids).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (got - want).abs().max() < tol * want.abs().max()
