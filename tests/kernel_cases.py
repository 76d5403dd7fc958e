"""Shared helpers for kernel tests: caches with zero-mean data, the bf16 error bar, poisoning."""

from __future__ import annotations

import math

import torch

from foscar import KVFormat, QuantizedKVCache
from foscar.reference import attend_dequantized, dequantize_sequence


def build_cache(
    fmt: KVFormat,
    lengths,
    *,
    num_kv_heads=2,
    head_dim=128,
    page_size=64,
    device="cpu",
    seed=0,
    decode_steps=2,
    shuffle_pages=True,
    v_offset=0.0,
):
    """A cache of ragged sequences (prefill + a few decode steps) with zero-mean K and V.

    Zero-mean data matter: with y = q + 128 operands the offsets nearly cancel the +128, which
    is where a correction computed from the wrong operand shows (Note [offset cancellation]).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages_needed = sum(math.ceil((n + decode_steps) / page_size) for n in lengths)
    num_pages = pages_needed + 5
    cache = QuantizedKVCache(
        fmt,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_pages=num_pages,
        max_seqs=len(lengths),
        page_size=page_size,
        device=device,
    )
    if shuffle_pages:  # pages out of order, so page-table indexing is exercised
        perm = torch.randperm(num_pages, generator=g).tolist()
        cache.set_free_order(perm)
    ids = [cache.add_sequence() for _ in lengths]
    total = sum(lengths)
    spread = torch.linspace(0.3, 2.0, head_dim)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g) * spread
    v = torch.randn(total, num_kv_heads, head_dim, generator=g) * spread.flip(0) + v_offset
    cache.append(ids, k.to(device), v.to(device), list(lengths))
    for _ in range(decode_steps):
        k = torch.randn(len(ids), num_kv_heads, head_dim, generator=g)
        v = torch.randn(len(ids), num_kv_heads, head_dim, generator=g)
        cache.append(ids, k.to(device), v.to(device))
    return cache, cache.plan(ids)


def queries(batch, num_q_heads, head_dim, device, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(batch.batch_size, num_q_heads, head_dim, generator=g).to(
        device, torch.bfloat16
    )


def bf16_torch_attention(q, cache, batch, sm_scale):
    """What a plain bf16 attention over the same dequantized cache computes (the error bar)."""
    outs = []
    h = cache.num_kv_heads
    for i in range(batch.batch_size):
        k, v = dequantize_sequence(cache, batch, i, torch.float32)
        ratio = q.shape[1] // h
        qq = q[i].float().reshape(h, ratio, -1)
        s = torch.einsum("hqd,hld->hql", qq, k.bfloat16().float()) * sm_scale
        p = torch.softmax(s, dim=-1).bfloat16().float()
        o = torch.einsum("hql,hld->hqd", p, v.bfloat16().float())
        outs.append(o.reshape(h * ratio, -1).bfloat16())
    return torch.stack(outs)


def _e4m3_round_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x rounded to E4M3 after a power-of-two scale per slice along ``dim`` that puts the
    slice's largest magnitude in [128, 256) (the Gluon kernel's Q and, up to the power of two,
    its P'), returned in x's scale and dtype."""
    amax = x.abs().amax(dim=dim, keepdim=True)
    scale = torch.exp2(7 - torch.floor(torch.log2(amax.clamp_min(1e-30))))
    return (x * scale).to(torch.float8_e4m3fn).to(x.dtype) / scale


def e4m3_torch_attention(q, cache, batch, sm_scale):
    """The error bar of the Gluon E4M3 operand path (GluonFlag.E4M3), as it rounds: attention
    over the same dequantized cache in fp64 with Q rounded to E4M3 per head, and the
    probabilities rounded (per head, relative to their largest) where they meet the centred
    codes only: ``sum_t P^_t (x_t - m_t) + P_t m_t`` with m_t the middle of the row's range
    (z + s c, c the middle code: token-wise min-max groups of head_dim, the only V the path
    reads). Returns (o, lse) like attend_dequantized."""
    outs, lses = [], []
    h = cache.num_kv_heads
    for i in range(batch.batch_size):
        k, v = dequantize_sequence(cache, batch, i, torch.float64)
        ratio = q.shape[1] // h
        qq = _e4m3_round_rows(q[i].double().reshape(h, ratio, -1), -1)
        s = torch.einsum("hqd,hld->hql", qq, k) * sm_scale
        lses.append(torch.logsumexp(s, dim=-1).reshape(h * ratio))
        p = torch.softmax(s, dim=-1)
        mid = (v.amin(-1, keepdim=True) + v.amax(-1, keepdim=True)) / 2  # [h, l, 1]
        o = torch.einsum("hql,hld->hqd", _e4m3_round_rows(p, -1), v - mid)
        o = o + torch.einsum("hql,hld->hqd", p, mid)
        outs.append(o.reshape(h * ratio, -1))
    return torch.stack(outs), torch.stack(lses)


def check_e4m3_against_reference(o, lse, q, cache, batch, *, sm_scale=None):
    """The E4M3 operand path's error against fp64 over the dequantized cache is at E4M3 level:
    within 2x that of an fp64 attention with Q and P rounded to E4M3 (e4m3_torch_attention);
    bf16's 5e-3 bar does not apply (3 mantissa bits; docs/tuning.md)."""
    sm_scale = 1 / math.sqrt(cache.head_dim) if sm_scale is None else sm_scale
    assert torch.isfinite(o).all(), "unwritten or non-finite output"
    ref, ref_lse = attend_dequantized(q.double(), cache, batch, sm_scale)
    o_e4m3, lse_e4m3 = e4m3_torch_attention(q, cache, batch, sm_scale)
    bar = rel_l2(o_e4m3, ref)
    err = rel_l2(o, ref)
    assert err <= max(2 * bar, 5e-3), f"error {err:.2e} > 2 x E4M3 torch attention {bar:.2e}"
    if lse is not None:
        assert torch.isfinite(lse).all()
        # the logits carry Q's E4M3 rounding (P's does not reach the LSE): within 2e-2 of the
        # deviation of the emulation's LSE, which rounds Q for every token (the kernel's BF16
        # windows take the bf16 Q: the H200 measured such a case past 2e-2 of the emulation)
        dev = float((lse.double() - ref_lse).abs().max())
        assert dev <= float((lse_e4m3 - ref_lse).abs().max()) + 2e-2, f"LSE off by {dev:.2e}"
    return err, bar


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def check_against_reference(o, lse, q, cache, batch, *, sm_scale=None):
    """The kernel's error against fp64 over the dequantized cache is at bf16 level."""
    sm_scale = 1 / math.sqrt(cache.head_dim) if sm_scale is None else sm_scale
    assert torch.isfinite(o).all(), "unwritten or non-finite output"
    ref, ref_lse = attend_dequantized(q.double(), cache, batch, sm_scale)
    bar = rel_l2(bf16_torch_attention(q, cache, batch, sm_scale), ref)
    err = rel_l2(o, ref)
    assert err <= max(2 * bar, 1e-3), f"error {err:.2e} > 2 x bf16 torch attention {bar:.2e}"
    assert err <= 5e-3, f"error {err:.2e} > 5e-3"
    if lse is not None:
        assert torch.isfinite(lse).all()
        # the logits carry bf16-level error (Q*s' rounds for channel-wise K)
        assert float((lse.double() - ref_lse).abs().max()) <= 2e-2
    return err, bar


# ---------------------------------------------------------------------------- E4M3 adversarial
#: E4M3's unit roundoff (3 mantissa bits, round to nearest) and the smallest normal / subnormal
E4M3_U = 2.0**-4
#: the inputs of the E4M3 accuracy tests: (name, what it stresses)
E4M3_ADVERSARIAL = {
    "gaussian": "zero-mean Gaussian Q, K, V (the tests' spreads)",
    "peaky": "Q 30x: logits spread over ~100 nats, one token per head takes the softmax",
    "flat": "Q 1e-3x: a flat softmax, Q's values 3 decades below the Gaussian's",
    "keys 100x": "K 100x the Gaussian's: large logits from the keys' side",
    "key offsets": "each key row offset by 20 N(0, 1): rows far from zero-mean",
    "key outlier": "key channel 3 offset by 50 in every token",
    "value decades": "value rows scaled by exp(3 N(0, 1)): s'_V over ~5 decades",
    "sink": "token 0 takes as much softmax mass as the flat tail of all the others, whose "
    "values share a mean",
}


def e4m3_adversarial_cache(
    kind,
    bits,
    *,
    clip_v=False,
    windows=False,
    page_size=64,
    ratio=4,
    length=2000,
    num_kv_heads=2,
    device="cpu",
    seed=0,
):
    """(cache, batch, q) of one sequence for an E4M3_ADVERSARIAL ``kind``: token-wise INT``bits``
    K and V (g = 128, head_dim 128), V clipped at the 0.9 percentile if ``clip_v``, BF16 sink
    and recent windows of 64 / 256 tokens if ``windows``."""
    from foscar import QuantFormat

    if kind not in E4M3_ADVERSARIAL:
        raise ValueError(f"kind must be one of {sorted(E4M3_ADVERSARIAL)}, got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    h, d, n = num_kv_heads, 128, length
    fmt = KVFormat(
        QuantFormat(bits, "token", 128),
        QuantFormat(bits, "token", 128, clip=0.9 if clip_v else None),
        sink_tokens=64 if windows else 0,
        recent_tokens=256 if windows else 0,
    )
    spread = torch.linspace(0.3, 2.0, d)
    k = torch.randn(n, h, d, generator=g) * spread
    v = torch.randn(n, h, d, generator=g) * spread.flip(0)
    q = torch.randn(1, h * ratio, d, generator=g)
    if kind == "peaky":
        q = q * 30
    elif kind == "flat":
        q = q * 1e-3
    elif kind == "keys 100x":
        k = k * 100
    elif kind == "key offsets":
        k = k + 20 * torch.randn(n, h, 1, generator=g)
    elif kind == "key outlier":
        k[..., 3] += 50
    elif kind == "value decades":
        v = v * torch.exp(3 * torch.randn(n, h, 1, generator=g))
    elif kind == "sink":
        q = q[:, ::ratio].repeat_interleave(ratio, dim=1)  # one query per KV head
        qh = q[0, ::ratio]  # [h, d]
        k[1:] *= 0.01
        # logit log(n) above the tail's (~0): P of the sink = the tail's sum
        k[0] = qh / qh.norm(dim=-1, keepdim=True) ** 2 * math.log(n) * math.sqrt(d)
        v[1:] += torch.randn(1, h, d, generator=g)
    cache = QuantizedKVCache(
        fmt,
        num_kv_heads=h,
        head_dim=d,
        num_pages=math.ceil(n / page_size) + 2,
        max_seqs=1,
        page_size=page_size,
        device=device,
    )
    ids = [cache.add_sequence()]
    cache.append(ids, k.to(device), v.to(device), [n])
    return cache, cache.plan(ids), q.to(device, torch.bfloat16)


def token_history(cache, batch, i, name):
    """Codes [H, n, D] (natural channel order) and the folded (s', z') [H, n] of sequence i's
    quantized history, role ``name``: token-wise groups of head_dim (the E4M3 path's formats)."""
    from foscar.formats import unpack_codes

    st = cache.layers[batch.layer]
    f = cache.role_format(batch.layer, name)
    if f.group_size != cache.head_dim or f.axis.value != "token":
        raise ValueError(f"token-wise groups of head_dim only, got {f.short()}")
    lq = batch.num_quantized_host[i]
    ps = batch.page_size
    start = int(batch.kv_indptr[i])
    pages = batch.kv_indices[start : int(batch.kv_indptr[i + 1])].long()
    t = torch.arange(lq, device=pages.device)
    words = getattr(st, f"{name}_words")[pages[t // ps], :, t % ps]  # [n, H, W]
    mapping = cache.layer_format(batch.layer).mapping
    codes = unpack_codes(words, f.bits, mapping, cache.channel_order(name, batch.layer))
    sz = getattr(st, f"{name}_scales")[pages[t // ps], :, t % ps]  # [n, H, 2]
    return codes.transpose(0, 1), sz[..., 0].transpose(0, 1), sz[..., 1].transpose(0, 1)


def _windows_of(cache, batch, i, k, v):
    """Sequence i's BF16 window tokens (sink, then recent) of its dequantized k, v [H, L, D]."""
    fmt = cache.layer_format(batch.layer)
    lq = batch.num_quantized_host[i]
    sink = fmt.sink_tokens if lq else 0  # (no history: every token is a window's)
    idx = torch.cat([torch.arange(sink), torch.arange(sink + lq, k.shape[1])])
    return k[:, idx], v[:, idx]


def e4m3_emulated_attention(q, cache, batch, sm_scale, **options):
    """foscar.kernels.e4m3_emulation over every sequence and KV head, its BF16 windows (the
    Triton window program's partial) in fp64, merged by the LSEs: o [B, Hq, D] float64."""
    from foscar.kernels.e4m3_emulation import emulate_head

    h = cache.num_kv_heads
    ratio = q.shape[1] // h
    v_bits = cache.role_format(batch.layer, "v").bits
    outs = []
    for i in range(batch.batch_size):
        k_all, v_all = dequantize_sequence(cache, batch, i, torch.float64)
        kw, vw = _windows_of(cache, batch, i, k_all, v_all)
        lq = batch.num_quantized_host[i]
        hist = (token_history(cache, batch, i, "k"), token_history(cache, batch, i, "v"))
        heads = []
        for j in range(h):
            qh = q[i, j * ratio : (j + 1) * ratio].cpu().float()
            parts = []
            if lq:
                kc, ks, kz = (x[j].cpu() for x in hist[0])
                vc, vs, vz = (x[j].cpu() for x in hist[1])
                k_hist, v_hist = (kc, ks, kz), (vc, vs, vz)
                parts.append(
                    emulate_head(qh, k_hist, v_hist, v_bits=v_bits, sm_scale=sm_scale, **options)
                )
            if kw.shape[1]:
                s = qh.double() @ kw[j].cpu().T * sm_scale
                parts.append((torch.softmax(s, -1) @ vw[j].cpu(), torch.logsumexp(s, -1)))
            lse = torch.stack([p[1] for p in parts])  # [parts, ratio]
            w = torch.softmax(lse, dim=0)
            heads.append(sum(w[p][:, None] * parts[p][0] for p in range(len(parts))))
        outs.append(torch.cat(heads))
    return torch.stack(outs)


def e4m3_error_bound(q, cache, batch, sm_scale, confidence=4.0) -> float:
    """A bound on the relative L2 error of the E4M3 path against fp64 attention over the
    dequantized cache, from E4M3's unit roundoff u = 2^-4 (foscar.kernels.e4m3_emulation has the
    arithmetic) in the probabilistic model of rounding errors (independent, mean zero, each
    within its bound; Higham and Mary, SIAM J. Sci. Comput. 2019): a sum of such errors e_i
    exceeds ``confidence`` sqrt(sum_i bound_i^2) with probability under 2 exp(-confidence^2 / 2)
    (Hoeffding). Per head, with weights P_n over the quantized tokens and the windows':
        Q~ = Q + dQ,  |dQ_d| <= u^2 |Q_d| + 2^-17 max|Q|   (two E4M3 terms; the smallest
                      subnormal 2^-9 at the head's scale, max |Q| 2^sigma >= 128)
        dO = sm_scale sum_d dQ_d G_d,  G_d = sum_n P_n x_nd (v_n - O) / sum P   (first order)
        dP'_n <= u P'_n + 2^-18 max P', P' = P s'_V (256 P' <= 256 against the running max of
                 S + log2 s'_V, a split's at most the largest; 2^-10 absolute below 2^-6)
        dO += sum_n dP'_n (q_n - C) / sum P   (P' = P s', codes q, middle code C)
    and the BF16 window tokens' P at u = 2^-8 (the Triton window program). Returns the bound's
    L2 over heads relative to ||O||."""
    h = cache.num_kv_heads
    ratio = q.shape[1] // h
    v_bits = cache.role_format(batch.layer, "v").bits
    c_mid = ((1 << v_bits) - 1) / 2
    lam = confidence
    num, den = 0.0, 0.0
    for i in range(batch.batch_size):
        k_all, v_all = dequantize_sequence(cache, batch, i, torch.float64)
        k_all, v_all = k_all.cpu(), v_all.cpu()
        kw, vw = _windows_of(cache, batch, i, k_all, v_all)
        lq = batch.num_quantized_host[i]
        vc, vs, _ = (x.cpu().double() for x in token_history(cache, batch, i, "v"))
        sink = cache.layer_format(batch.layer).sink_tokens if lq else 0
        kq, vq = k_all[:, sink : sink + lq], v_all[:, sink : sink + lq]
        codes = (vc - c_mid).norm(dim=-1)  # [H, n]
        for j in range(h):
            qh = q[i, j * ratio : (j + 1) * ratio].cpu().double()  # [r, D]
            dq = E4M3_U**2 * qh.abs() + 2.0**-17 * qh.abs().amax(-1, keepdim=True)
            s_q = qh @ kq[j].T * sm_scale  # [r, n]
            s_w = qh @ kw[j].T * sm_scale
            top = torch.cat([s_q, s_w], -1).amax(-1, keepdim=True)
            p_q, p_w = torch.exp(s_q - top), torch.exp(s_w - top)
            total = p_q.sum(-1) + p_w.sum(-1)  # [r]
            o = (p_q @ vq[j] + p_w @ vw[j]) / total[:, None]  # [r, D]
            # Q: G sum P [r, D (d), D (e)] over the quantized tokens (windows: the bf16 Q)
            g = torch.einsum("rn,nd,rne->rde", p_q, kq[j], vq[j][None] - o[:, None])
            err_q = sm_scale * (dq[:, :, None] * g).norm(dim=(1, 2))
            pv = p_q * vs[j][None]  # P' (up to the shared scale)
            err_p = ((E4M3_U * pv + 2.0**-18 * pv.amax(-1, keepdim=True)) * codes[j][None]).norm(
                dim=-1
            )
            err_w = (2.0**-8 * p_w * vw[j].norm(dim=-1)[None]).norm(dim=-1)
            err = lam * (err_q + err_p + err_w) / total  # (g, err_p, err_w: times sum P)
            num += float((err**2).sum())
            den += float((o**2).sum())
    return math.sqrt(num / den)
