"""The transformers integration: generation through FoscarCache against an independent reference.

The reference is a second attention function over transformers' own ``DynamicCache`` (full
precision, pads stored): at every decode step it takes each row's real tokens, applies the
format's policy by itself (BF16 sink, quantize-dequantize the history with ``foscar.quantize``,
BF16 tail; channel-wise groups in whole quanta) and attends in float64. It shares nothing with
the integration or the cache (no pages, packing, folding, ring buffers, plans or pad handling),
so a wrong page, row, layer, position or head mapping anywhere shows up as a logit gap.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the transformers integration needs transformers (foscar[hf])"
)

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from foscar import KVFormat, QuantFormat, layer_formats  # noqa: E402
from foscar.integrations.transformers import (  # noqa: E402
    FoscarCache,
    cache_kwarg,
    foscar_attention,
    register,
    use_foscar_attention,
)
from foscar.quantize import dequantize, quantize  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REF_ATTENTION = "foscar_test_reference"
CHECKED_ATTENTION = "foscar_test_checked"
PAGE = 16  # small pages, so that generation crosses page boundaries


# ---------------------------------------------------------------------------- the reference
def fake_quantize(x: torch.Tensor, fmt: KVFormat, f: QuantFormat) -> torch.Tensor:
    """What the cache holds for one sequence's ``x: [H, n, D]``, dequantized, in float64."""
    x = x.to(torch.bfloat16)  # the cache rounds every token to BF16 on entry
    n = x.shape[1]
    s, w, quantum = fmt.sink_tokens, fmt.recent_tokens, fmt.demotion_quantum
    lq = max(0, n - s - w) // quantum * quantum
    parts = [x[:, :s].double()]
    if lq:
        codes, scale, offset = quantize(x[:, s : s + lq], f)
        parts.append(dequantize(codes, scale, offset, f, dtype=torch.float64))
    parts.append(x[:, s + lq :].double())
    return torch.cat(parts, dim=1)


def attend_reference(query, keys, values, real, fmt: KVFormat, scaling: float) -> torch.Tensor:
    """Decode attention of ``query: [B, H_q, 1, D]`` over ``keys, values: [B, H_kv, L, D]``
    (pads included; ``real: [B, L]`` bool), the format applied by :func:`fake_quantize`, in
    float64. Returns ``[B, 1, H_q, D]`` float64."""
    bsz, hq, _, d = query.shape
    group = hq // keys.shape[1]
    outs = []
    for b in range(bsz):
        k = fake_quantize(keys[b][:, real[b]], fmt, fmt.key).repeat_interleave(group, 0)
        v = fake_quantize(values[b][:, real[b]], fmt, fmt.value).repeat_interleave(group, 0)
        s = torch.einsum("hd,hld->hl", query[b, :, 0].double(), k) * scaling
        outs.append(torch.einsum("hl,hld->hd", torch.softmax(s, -1), v))
    return torch.stack(outs).unsqueeze(1)


def extend_reference(query, past_k, past_v, key, value, real, fmt, scaling) -> torch.Tensor:
    """Several new tokens on a non-empty cache: each row's stored past (``past_*: [B, H_kv,
    P, D]``, real tokens per ``real[:, :P]``) as the cache holds it, plus the new tokens at full
    precision, causal among themselves and without pads. Returns ``[B, T, H_q, D]`` float64."""
    bsz, hq, t, d = query.shape
    group = hq // key.shape[1]
    p = past_k.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    outs = []
    for b in range(bsz):
        k = torch.cat([fake_quantize(past_k[b][:, real[b, :p]], fmt, fmt.key), key[b].double()], 1)
        v = torch.cat(
            [fake_quantize(past_v[b][:, real[b, :p]], fmt, fmt.value), value[b].double()], 1
        )
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        s = torch.einsum("htd,hld->htl", query[b].double(), k) * scaling
        visible = torch.cat(
            [torch.ones(t, k.shape[1] - t, dtype=torch.bool), causal & real[b, p:]], 1
        )
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("htl,hld->thd", torch.softmax(s, -1), v))
    return torch.stack(outs)


def _layer_format(fmt, module) -> KVFormat:
    """``fmt``, or its layer's entry where it gives one format per layer."""
    return fmt if isinstance(fmt, KVFormat) else fmt[module.layer_idx]


def _real(attention_mask, bsz, length):
    if attention_mask is None:
        return torch.ones(bsz, length, dtype=torch.bool)
    return attention_mask[:, 0, -1, -length:].expand(bsz, length)


class Reference:
    """Dequantize-then-attend in float64 over a DynamicCache: an independent run of the model."""

    fmt: KVFormat | None = None

    @staticmethod
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        if query.shape[2] > 1:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
            )
        real = _real(attention_mask, query.shape[0], key.shape[2])
        fmt = _layer_format(Reference.fmt, module)
        out = attend_reference(query, key, value, real, fmt, scaling)
        return out.to(query.dtype), None


class Checked:
    """foscar's attention, checked at every decode call against :func:`attend_reference` on the
    very K/V the model produced in this run (a shadow copy of every layer's K/V, pads included).

    Both sides see identical inputs, so the gap is the decode arithmetic alone; an end-to-end
    comparison of two runs also carries 1-ulp differences of K/V that can move a quantization
    code (see :func:`assert_matches_reference`).
    """

    fmt: KVFormat | None = None
    shadow: dict = {}
    worst = 0.0
    calls = 0

    @staticmethod
    def reset(fmt):
        Checked.fmt, Checked.shadow, Checked.worst, Checked.calls = fmt, {}, 0.0, 0

    @staticmethod
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        out, _ = foscar_attention(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
        )
        layer = module.layer_idx
        past_k, past_v = Checked.shadow.get(layer, (key[:, :, :0], value[:, :, :0]))
        keys, values = torch.cat([past_k, key], 2), torch.cat([past_v, value], 2)
        Checked.shadow[layer] = (keys, values)
        if past_k.shape[2] == 0:  # prefill: SDPA over the K/V passed in
            return out, None
        real = _real(attention_mask, query.shape[0], keys.shape[2])
        fmt = _layer_format(Checked.fmt, module)
        if query.shape[2] == 1:
            ref = attend_reference(query, keys, values, real, fmt, scaling)
        else:
            ref = extend_reference(query, past_k, past_v, key, value, real, fmt, scaling)
        err = ((out.double() - ref).abs().amax() / ref.abs().amax()).item()
        Checked.worst = max(Checked.worst, err)
        Checked.calls += 1
        return out, None


Checked.attention.uses_foscar_cache = True


@pytest.fixture(scope="module")
def tiny():
    """A random Llama: 3 layers, 4 query / 2 KV heads, head_dim 32 (GQA 2)."""
    register_references()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


def register_references():
    register()
    for name, fn in ((REF_ATTENTION, Reference.attention), (CHECKED_ATTENTION, Checked.attention)):
        transformers.AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)


def ragged_batch(lengths: list[int], seed: int = 0, vocab: int = 96) -> dict:
    """Left-padded ``input_ids``/``attention_mask`` of rows with ``lengths`` real tokens."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, t - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, t - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def foscar_generate(model, enc, fmt, new_tokens, checked=False, **cache_args):
    """Generate through a FoscarCache (decode="kernel" unless ``cache_args`` say otherwise)."""
    cache_args.setdefault("decode", "kernel")
    if checked:
        Checked.reset(fmt)
        model.set_attn_implementation(CHECKED_ATTENTION)
    else:
        use_foscar_attention(model)
    cache = FoscarCache(fmt, model.config, page_size=PAGE, **cache_args)
    out = model.generate(
        **enc,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **{cache_kwarg(model): cache},
    )
    return out.sequences, torch.stack(out.logits, 1), cache


@torch.no_grad()
def reference_logits(model, enc, fmt, sequences) -> torch.Tensor:
    """Teacher-force ``sequences`` through the reference; logits of every generated position."""
    Reference.fmt = fmt
    model.set_attn_implementation(REF_ATTENTION)
    kw = cache_kwarg(model)
    t = enc["input_ids"].shape[1]
    mask = torch.cat(
        [enc["attention_mask"], torch.ones(len(sequences), sequences.shape[1] - t).long()], 1
    )
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    out = model(
        input_ids=sequences[:, :t],
        attention_mask=mask[:, :t],
        position_ids=pos[:, :t],
        **{kw: cache},
    )
    logits = [out.logits[:, -1]]
    for i in range(t, sequences.shape[1] - 1):
        out = model(
            input_ids=sequences[:, i : i + 1],
            attention_mask=mask[:, : i + 1],
            position_ids=pos[:, i : i + 1],
            **{kw: cache},
        )
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def assert_matches_reference(model, enc, fmt, new_tokens, **cache_args):
    """Generate through FoscarCache and compare (1) every decode call's attention output with
    dequantize-then-attend on the same K/V, to fp32 rounding, and (2) every step's logits with
    an independent teacher-forced run of the same model through :class:`Reference`."""
    seqs, logits, cache = foscar_generate(model, enc, fmt, new_tokens, checked=True, **cache_args)
    layers = model.config.num_hidden_layers
    formats = layer_formats(fmt, layers)
    label = ", ".join(dict.fromkeys(f.short() for f in formats))
    assert Checked.calls == (new_tokens - 1) * layers
    # fp32 arithmetic with the bf16 mapping's +128 offset folded out (design.md): ~1e-4
    assert Checked.worst < 1e-3, f"{label}: attention output off by {Checked.worst:.3g}"
    ref = reference_logits(model, enc, fmt, seqs)
    assert logits.shape == ref.shape
    # bf16 level: 2^-8 of the logits' spread. With 2-bit codes a 1-ulp difference in a K/V
    # value (the two runs' attention arithmetic differs in the last bits, fp32 against fp64)
    # can move a code by a third of its group's range, so INT2 gets 2^-5.
    low_bits = any(min(f.key.bits, f.value.bits) < 4 and f.recent_tokens < 256 for f in formats)
    tol = ref.std().item() * (2**-5 if low_bits else 2**-8)
    err = (logits - ref).abs().max().item()
    assert err < tol, f"{label}: max |logit - reference| = {err:.3g} > {tol:.3g}"
    return seqs, logits, cache


# ---------------------------------------------------------------------------- formats
FORMATS = {
    f"INT{bits} K{ka} V{va}{' clipped' if clip else ''}": KVFormat(
        QuantFormat(bits, ka, 32, 0.9 if clip else None),
        QuantFormat(bits, va, 32, 0.85 if clip else None),
    )
    for bits in (2, 4)
    for ka in ("token", "channel")
    for va in ("token", "channel")
    for clip in (False, True)
}
FORMATS["BF16"] = KVFormat(
    QuantFormat(4, "token", 32), QuantFormat(4, "token", 32), recent_tokens=256
)
FORMATS["INT2 KIVI + windows"] = KVFormat(
    QuantFormat(2, "channel", 32), QuantFormat(2, "token", 32), sink_tokens=4, recent_tokens=8
)
FORMATS["INT4 token clipped + windows"] = KVFormat(
    QuantFormat(4, "token", 32, 0.9),
    QuantFormat(4, "token", 32, 0.85),
    sink_tokens=4,
    recent_tokens=8,
)


@pytest.mark.parametrize("name", list(FORMATS))
def test_generation_matches_dequantized_reference(tiny, name):
    """Every format: ragged batch, 40 tokens generated from prompts of 23 and 57 tokens, so the
    history crosses pages of 16 tokens and channel-wise groups of 32 while generating."""
    enc = ragged_batch([23, 57], seed=1)
    seqs, _, cache = assert_matches_reference(tiny, enc, FORMATS[name], 40)
    assert cache.stored_lengths(0) == [23 + 40 - 1, 57 + 40 - 1]  # the last token is not fed
    assert cache.get_seq_length() == 57 + 40 - 1


#: one format per layer of the tiny model (3 layers): widths, clips and axes differ by layer, the
#: windows and the demotion quantum (channel-wise groups of 32 in the second) do not
LAYER_FORMATS = {
    "token-wise, widths by layer": tuple(
        KVFormat(QuantFormat(kb, "token", 32, clip), QuantFormat(vb, "token", 32), "bf16", 4, 8)
        for kb, vb, clip in ((2, 2, 0.9), (4, 2, None), (2, 4, 0.85))
    ),
    "channel-wise keys, widths by layer": tuple(
        KVFormat(QuantFormat(kb, "channel", 32), QuantFormat(vb, va, 32))
        for kb, vb, va in ((4, 2, "token"), (2, 2, "channel"), (2, 4, "token"))
    ),
}


@pytest.mark.parametrize("decode", ["kernel", "dequantized"])
@pytest.mark.parametrize("name", list(LAYER_FORMATS))
def test_generation_with_a_format_per_layer(tiny, name, decode):
    """FoscarCache with one format per layer: every decode call of layer ``i`` checked against
    dequantize-then-attend in layer ``i``'s own format, and the logits against a teacher-forced
    reference run with the same per-layer formats."""
    fmt = LAYER_FORMATS[name]
    enc = ragged_batch([23, 57], seed=2)
    _, logits, cache = assert_matches_reference(tiny, enc, fmt, 40, decode=decode)
    assert cache.kv.formats == fmt and cache.kv.mixed_formats
    # not the same model as any one format everywhere
    for f in dict.fromkeys(fmt):
        _, other, _ = foscar_generate(tiny, enc, f, 40, decode=decode)
        assert not torch.equal(logits, other)


@pytest.mark.parametrize(
    "name",
    [
        "BF16",
        "INT2 Ktoken Vtoken",
        "INT4 Kchannel Vtoken",
        "INT2 Kchannel Vchannel clipped",
        "INT2 KIVI + windows",
        "INT4 token clipped + windows",
    ],
)
def test_dequantized_decode_matches_reference(tiny, name):
    """decode="dequantized" (the eval's CPU path: each history token dequantized once, kept
    across steps): every decode call checked against dequantize-then-attend, ragged rows whose
    histories grow through pages, channel-wise groups and window demotions while generating."""
    enc = ragged_batch([23, 57], seed=1)
    _, logits, cache = assert_matches_reference(tiny, enc, FORMATS[name], 40, decode="dequantized")
    assert cache.decode == "dequantized" and cache.dequantized_history(0) is not None
    # the same tokens and logits as the kernel path (INT2 codes can flip on a 1-ulp K/V
    # difference between the two runs: the tolerance of assert_matches_reference)
    _, ref, _ = foscar_generate(tiny, enc, FORMATS[name], 40)
    assert (logits - ref).abs().max() < ref.std() * 2**-5


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_default_decode_is_the_dequantized_path_where_the_reference_would_run(tiny, backend):
    """FoscarCache's default decode="auto": on a CPU (or with the reference backend), where
    decode_attention runs its torch reference, it takes the dequantized path, the same tokens
    and logits as decode="dequantized" bit for bit."""
    enc = ragged_batch([23, 57], seed=1)
    fmt = FORMATS["INT2 KIVI + windows"]
    seqs, logits, cache = foscar_generate(tiny, enc, fmt, 12, decode="auto", backend=backend)
    assert FoscarCache(fmt, tiny.config).decode == "auto"  # the default
    assert cache.decode_path == "dequantized" and cache.dequantized_history(0) is not None
    want_seqs, want, _ = foscar_generate(tiny, enc, fmt, 12, decode="dequantized", backend=backend)
    assert torch.equal(seqs, want_seqs) and torch.equal(logits, want)


def test_dequantized_history_grows_with_the_tokens_stored():
    """The dequantized path's fp32 copy grows by doubling up to the cache's max length, not
    allocated at the max length at once (a model's max_position_embeddings can be 128K)."""
    from foscar import QuantizedKVCache
    from foscar.integrations.transformers import DequantizedHistory

    fmt = KVFormat(QuantFormat(4, "token", 32), QuantFormat(4, "token", 32), "bf16", 4, 8)
    kv = QuantizedKVCache(fmt, num_kv_heads=2, head_dim=32, num_pages=16, max_seqs=1, page_size=16)
    sid = kv.add_sequence()
    kv.append([sid], torch.randn(20, 2, 32), torch.randn(20, 2, 32), num_new_tokens=[20])
    memo = DequantizedHistory(capacity=100_000)
    caps = []
    for _ in range(30):
        kv.append([sid], torch.randn(1, 2, 32), torch.randn(1, 2, 32), num_new_tokens=[1])
        memo.attend(torch.randn(1, 4, 32), kv, kv.plan([sid], 0), 0.2)
        caps.append(memo.k.shape[2])
    assert caps[0] == 21 and caps[-1] == 84 and sorted(set(caps)) == [21, 42, 84]


def test_dequantized_decode_of_a_rotated_cache():
    """With OSCAR rotations on a layer, decode="dequantized" returns decode_attention's output
    (q rotated by R_K, the output by R_V^T) at every step of a growing cache."""
    from foscar.decode import decode_attention
    from foscar.integrations.transformers import DequantizedHistory

    torch.manual_seed(5)
    h, d = 2, 32
    fmt = KVFormat(
        QuantFormat(2, "token", 32, 0.9),
        QuantFormat(2, "token", 32),
        sink_tokens=4,
        recent_tokens=8,
    )
    from foscar import QuantizedKVCache

    kv = QuantizedKVCache(fmt, num_kv_heads=h, head_dim=d, num_pages=16, max_seqs=2, page_size=16)
    rk = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0]
    rv = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0]
    kv.set_transform(0, key_rotation=rk, value_rotation=rv)
    ids = [kv.add_sequence(), kv.add_sequence()]
    kv.append(ids, torch.randn(30, h, d), torch.randn(30, h, d), num_new_tokens=[10, 20])
    memo = DequantizedHistory()
    for _ in range(25):
        kv.append(ids, torch.randn(2, h, d), torch.randn(2, h, d), num_new_tokens=[1, 1])
        plan = kv.plan(ids, 0)
        q = torch.randn(2, 4, d)
        ref = decode_attention(q.double(), kv, plan, sm_scale=0.2).float()
        torch.testing.assert_close(memo.attend(q, kv, plan, 0.2), ref, atol=2e-5, rtol=2e-5)


def test_windows_and_groups_are_crossed_during_generation(tiny):
    """With sink 4 + recent 8 and channel-wise K (g = 32), a 9-token prompt starts entirely in
    BF16; generation demotes the first group at 4 + 8 + 32 = 44 tokens, the second at 76."""
    fmt = FORMATS["INT2 KIVI + windows"]
    enc = ragged_batch([9], seed=2)
    _, _, cache = assert_matches_reference(tiny, enc, fmt, 72)
    stats = cache.memory_stats()
    assert stats["quantized_tokens"] == 3 * 64 and stats["window_tokens"] == 3 * (80 - 64)
    assert len(cache.kv.pages_of(cache.seq_ids[0])) == 4  # 64 quantized tokens, pages of 16


def test_left_padded_row_equals_the_prompt_alone(tiny):
    """Pads are not stored: in a left-padded batch each row generates exactly what its prompt
    generates alone, with the same cache contents (channel-wise groups would see pads if not)."""
    fmt = FORMATS["INT2 Kchannel Vchannel"]
    enc = ragged_batch([11, 50, 33], seed=3)
    seqs, logits, _ = foscar_generate(tiny, enc, fmt, 24)
    t = enc["input_ids"].shape[1]
    for i, n in enumerate([11, 50, 33]):
        alone = {k: v[i : i + 1, t - n :] for k, v in enc.items()}
        s1, l1, _ = foscar_generate(tiny, alone, fmt, 24)
        assert torch.equal(s1[0, n:], seqs[i, t:])
        torch.testing.assert_close(l1[0], logits[i], atol=1e-4, rtol=1e-4)


def test_bf16_format_matches_dynamic_cache(tiny):
    """Everything in the BF16 window: the same tokens as transformers' own cache and SDPA."""
    enc = ragged_batch([14, 30], seed=4)
    seqs, logits, _ = foscar_generate(tiny, enc, FORMATS["BF16"], 30)
    tiny.set_attn_implementation("sdpa")
    out = tiny.generate(
        **enc,
        max_new_tokens=30,
        min_new_tokens=30,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    ref = torch.stack(out.logits, 1)
    assert (logits - ref).abs().max() < ref.std() * 2**-7  # K/V rounded to bf16 in the cache
    assert torch.equal(out.sequences, seqs)


def test_continued_generation_extends_the_cache(tiny):
    """A second generate call on the same cache with a longer input (a continued conversation)
    attends 7 new tokens at once over the dequantized cache (checked per call), then decodes."""
    fmt = FORMATS["INT2 Kchannel Vtoken clipped"]
    enc = ragged_batch([20, 45], seed=5)
    seqs, _, cache = foscar_generate(tiny, enc, fmt, 10, checked=True)
    more = torch.cat(
        [seqs, torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(5))], 1
    )
    enc2 = {
        "input_ids": more,
        "attention_mask": torch.cat([enc["attention_mask"], torch.ones(2, 16).long()], 1),
    }
    calls = Checked.calls
    out = tiny.generate(
        **enc2,
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        **{cache_kwarg(tiny): cache},
    )
    assert Checked.calls - calls == 3 * 12  # one extend step and 11 decode steps per layer
    assert Checked.worst < 1e-3
    assert cache.stored_lengths(0) == [20 + 16 + 12 - 1, 45 + 16 + 12 - 1]
    assert out.shape[1] == more.shape[1] + 12


@pytest.mark.parametrize("decode", ["kernel", "dequantized"])
def test_one_planned_step_per_decode_step(tiny, monkeypatch, decode):
    """Each decode step is planned once, for every layer (QuantizedKVCache.plan_decode_step);
    no layer plans its own page tables."""
    from foscar import QuantizedKVCache

    steps, plans = [], []
    plan_step, plan = QuantizedKVCache.plan_decode_step, QuantizedKVCache.plan

    def counting_step(self, *args, **kwargs):
        step = plan_step(self, *args, **kwargs)
        steps.append(step)
        return step

    def counting_plan(self, *args, **kwargs):
        plans.append(args)
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(QuantizedKVCache, "plan_decode_step", counting_step)
    monkeypatch.setattr(QuantizedKVCache, "plan", counting_plan)
    enc = ragged_batch([10, 20], seed=6)
    use_foscar_attention(tiny)
    cache = FoscarCache(FORMATS["INT4 Ktoken Vtoken"], tiny.config, page_size=PAGE, decode=decode)
    tiny.generate(
        **enc, max_new_tokens=6, min_new_tokens=6, do_sample=False, **{cache_kwarg(tiny): cache}
    )
    assert len(steps) == 5 and not plans
    assert all(s.written == set(range(cache.num_layers)) for s in steps)
    assert all([b.layer for b in s.batches] == list(range(cache.num_layers)) for s in steps)


# ---------------------------------------------------------------------------- rejected input
def test_a_dropped_cache_frees_its_pool_without_the_garbage_collector(tiny):
    """No reference cycle: `del cache` frees the page pool at once (on a GPU, its memory)."""
    import gc
    import weakref

    enc = ragged_batch([5, 9])
    _, _, cache = foscar_generate(tiny, enc, FORMATS["INT2 KIVI + windows"], 4)
    pool = weakref.ref(cache.kv.layers[0].k_words)
    gc.disable()
    try:
        del cache
        assert pool() is None
    finally:
        gc.enable()


def test_deepcopy_and_pickle_keep_the_layer_views_on_their_own_cache(tiny):
    """transformers reuses a prompt cache through copy.deepcopy: the copy's layer views must
    answer for the copy (and outlive the original)."""
    import copy
    import pickle

    enc = ragged_batch([6, 3])
    _, _, cache = foscar_generate(tiny, enc, FORMATS["INT2 KIVI + windows"], 3)
    seen = cache.get_seq_length(0)
    twin = copy.deepcopy(cache)
    loaded = pickle.loads(pickle.dumps(cache))
    for c in (twin, loaded):
        assert torch.equal(c.kv.layers[0].k_words, cache.kv.layers[0].k_words)
    del cache
    twin.reset()  # the copy's views answer for the copy, the loaded one's for the loaded one
    assert [layer.get_seq_length() for layer in twin.layers] == [0] * len(twin.layers)
    assert twin.layers[0].get_mask_sizes(1) == (1, 0)
    assert [layer.get_seq_length() for layer in loaded.layers] == [seen] * len(loaded.layers)
    assert loaded.layers[0].get_mask_sizes(1) == (seen + 1, 0)


def test_decode_write_reaches_the_pool(tiny):
    _, _, cache = foscar_generate(
        tiny, ragged_batch([4]), FORMATS["INT2 KIVI + windows"], 2, decode_write="torch"
    )
    assert cache.kv.decode_write == "torch"
    with pytest.raises(ValueError, match="decode_write must be one of"):
        FoscarCache(FORMATS["INT2 KIVI + windows"], tiny.config, decode_write="triton")


def test_rejected_configurations_fail_at_construction(tiny):
    fmt_bad = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64))  # D = 32
    with pytest.raises(ValueError, match=r"fmt does not fit this model.*head_dim \(32\).*64"):
        FoscarCache(fmt_bad, tiny.config)
    fmt = FORMATS["BF16"]
    with pytest.raises(ValueError, match="page_size"):
        FoscarCache(fmt, tiny.config, page_size=24)
    with pytest.raises(TypeError, match="fmt must be a foscar.KVFormat"):
        FoscarCache("int4", tiny.config)
    with pytest.raises(ValueError, match="backend"):
        FoscarCache(fmt, tiny.config, backend="cuda")
    with pytest.raises(ValueError, match="num_layers is needed"):
        FoscarCache(fmt)
    sliding = LlamaConfig(**{**tiny.config.to_dict(), "layer_types": None})
    sliding.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="full-attention layers only"):
        FoscarCache(fmt, sliding)


def test_rejected_use(tiny):
    fmt = FORMATS["INT4 Ktoken Vtoken"]
    enc = ragged_batch([5, 9], seed=7)
    tiny.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="use_foscar_attention"):
        tiny.generate(**enc, max_new_tokens=2, **{cache_kwarg(tiny): FoscarCache(fmt, tiny.config)})
    use_foscar_attention(tiny)
    right = dict(enc)
    right["attention_mask"] = enc["attention_mask"].flip(1)  # right padding
    with pytest.raises(ValueError, match="left padding only"):
        tiny(**right, **{cache_kwarg(tiny): FoscarCache(fmt, tiny.config)})
    small = FoscarCache(fmt, tiny.config, max_cache_len=16, page_size=PAGE)
    with pytest.raises(ValueError, match="larger max_cache_len"):
        tiny.generate(**enc, max_new_tokens=20, min_new_tokens=20, **{cache_kwarg(tiny): small})
    cache = FoscarCache(fmt, tiny.config)
    tiny(**enc, **{cache_kwarg(tiny): cache})
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(NotImplementedError, match="append-only"):
        cache.crop(-1)


# ---------------------------------------------------------------------------- SmolLM2
# (the model comes from conftest's session fixture ``smollm2``, loaded once per run)
def _chat(tok, text):
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_smollm2_short_generation(smollm2):
    """The real model answers through an INT4 cache (CI runs this one)."""
    model, tok = smollm2
    enc = tok(_chat(tok, "What is the capital of France?"), return_tensors="pt")
    fmt = KVFormat(QuantFormat(4, "token", 64), QuantFormat(4, "token", 64))  # every token INT4
    use_foscar_attention(model)
    out = model.generate(
        **enc,
        max_new_tokens=12,
        do_sample=False,
        **{cache_kwarg(model): FoscarCache(fmt, model.config)},
    )
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_smollm2_batch_matches_reference(smollm2):
    """A left-padded batch of two chat prompts through INT2 KIVI with windows, 64 tokens: every
    decode call of the 30 layers matches dequantize-then-attend on the same K/V, and the padded
    row generates what its prompt generates alone.

    No end-to-end logit comparison here: in SmolLM2 a 1e-5 difference between two runs grows to
    ~0.05 by layer 12 wherever a code flips (its K rows span wide ranges, so one INT4 step is
    large), so two separate runs differ for reasons that have nothing to do with the cache.
    """
    model, tok = smollm2
    register_references()
    prompts = ["What is the capital of France?", "Write one sentence about the sea and the moon."]
    enc = tok([_chat(tok, p) for p in prompts], return_tensors="pt", padding=True)
    fmt = KVFormat(
        QuantFormat(2, "channel", 64), QuantFormat(2, "token", 64), sink_tokens=16, recent_tokens=16
    )
    seqs, logits, cache = foscar_generate(model, enc, fmt, 64, checked=True)
    assert Checked.calls == 63 * 30 and Checked.worst < 1e-3
    assert cache.memory_stats()["quantized_tokens"] > 0
    n = int(enc["attention_mask"][0].sum())
    alone = {k: v[:1, -n:] for k, v in enc.items()}
    s1, l1, _ = foscar_generate(model, alone, fmt, 64)
    t = enc["input_ids"].shape[1]
    assert torch.equal(s1[0, n:], seqs[0, t:])
