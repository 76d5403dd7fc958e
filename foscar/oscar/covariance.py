"""OSCAR's covariance targets, accumulated in float64 while calibration text streams through.

For one layer, ``H`` KV heads with ``g`` query heads each, and one sequence of ``T`` tokens with
post-RoPE ``q: [H*g, T, d]``, ``k, v: [H, T, d]`` (query head ``j`` reads KV head ``j // g``):

* **key target** ``C_Q[h] = sum_{t, j in group(h)} q_{j,t}^T q_{j,t} / (T * g)``, uncentred
  (the expected outer product of the queries that will meet head ``h``'s keys; the logit error
  of a key error ``e`` is ``q . e``, whose mean square is ``e C_Q e^T``);
* **value target** (the paper's) ``C_S[h] = sum_{j in group(h)} V_h^T S_j^T S_j V_h / (T * g)``
  with ``S_j`` the causal softmax attention matrix of query head ``j`` (``[T, T]``). Since
  ``S_j V_h`` is that head's attention output ``O_j``, this is ``O_j^T O_j`` summed over heads:
  computed here over chunks of ``chunk`` queries (each chunk's scores against the keys it may
  see), so memory stays ``O(chunk * T)`` whatever the length;
* **proxy value target** (the released code's diagonal proxy) ``C_V[h] = sum_t w_t v_t^T v_t /
  sum_t w_t`` with ``w_t = k_t C_Q[h] k_t^T`` (the expected squared logit of key ``t``): it
  needs the final ``C_Q``, so it is a second pass over the text;
* **plain targets** (an ablation) ``K^T K / T`` and ``V^T V / T``.

And one metric that is not a rotation target (our extension): the keys' metric
for GPTQ rounding weighted by what a key error costs the output
(:func:`attention_key_moment`).

Sums and token counts are kept separately, so sequences of any lengths add up exactly; a target
is ``sum / count``. Per-layer targets (one rotation shared by the KV heads, as in the released
code) average the per-head targets.
"""

from __future__ import annotations

import torch

__all__ = [
    "query_moment",
    "score_weighted_value_moment",
    "proxy_value_moment",
    "plain_moment",
    "attention_key_moment",
    "LayerMoments",
]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> int:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q and k must be [heads, tokens, head_dim], got {list(q.shape)} and {list(k.shape)}"
        )
    if q.shape[1:] != k.shape[1:] or (v is not None and v.shape != k.shape):
        raise ValueError(
            f"q, k, v must share tokens and head_dim, got {list(q.shape)}, {list(k.shape)}"
            + ("" if v is None else f", {list(v.shape)}")
        )
    if q.shape[0] % k.shape[0]:
        raise ValueError(
            f"query heads ({q.shape[0]}) must be a multiple of KV heads ({k.shape[0]})"
        )
    return q.shape[0] // k.shape[0]


def query_moment(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``sum_{t, j in group(h)} q_{j,t}^T q_{j,t}`` per KV head: ``q: [H*g, T, d]`` ->
    ``[H, d, d]`` float64 (divide by ``T * g`` for ``C_Q``)."""
    hq, t, d = q.shape
    if hq % num_kv_heads:
        raise ValueError(f"query heads ({hq}) must be a multiple of num_kv_heads ({num_kv_heads})")
    x = q.to(torch.float64).reshape(num_kv_heads, hq // num_kv_heads * t, d)
    return x.transpose(1, 2) @ x


def score_weighted_value_moment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    *,
    chunk: int = 512,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``sum_{j in group(h)} V_h^T S_j^T S_j V_h`` per KV head, ``S`` the causal softmax.

    ``q: [H*g, T, d]``, ``k, v: [H, T, d]`` of one sequence (query ``t`` sees keys ``0..t``);
    ``scaling`` multiplies the logits. Scores and outputs are computed in ``dtype`` over
    ``chunk`` queries at a time, and ``O^T O`` is accumulated in float64. Returns ``[H, d, d]``
    float64 (divide by ``T * g`` for ``C_S``).
    """
    g = _check_qkv(q, k, v)
    h, t, d = k.shape
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    qg = q.to(dtype).reshape(h, g, t, d)
    kd, vd = k.to(dtype), v.to(dtype)
    out = torch.zeros(h, d, d, dtype=torch.float64, device=q.device)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        s = torch.einsum("hgnd,htd->hgnt", qg[:, :, a:b], kd[:, :b]) * scaling
        # query a+i sees keys 0..a+i
        future = torch.arange(b, device=q.device) > torch.arange(a, b, device=q.device)[:, None]
        s = s.masked_fill(future, float("-inf"))
        o = torch.einsum("hgnt,htd->hgnd", torch.softmax(s, dim=-1), vd[:, :b])
        o = o.reshape(h, -1, d).to(torch.float64)
        out += o.transpose(1, 2) @ o
    return out


def proxy_value_moment(
    k: torch.Tensor, v: torch.Tensor, key_target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The released code's diagonal proxy: ``(sum_t w_t v_t^T v_t, sum_t w_t)`` per KV head with
    ``w_t = k_t C k_t^T``; ``k, v: [H, T, d]``, ``key_target: [H, d, d]`` (``C_Q``).

    Returns ``([H, d, d], [H])`` float64; their ratio is the mean-1-normalised target.
    """
    _check_qkv(k, k, v)
    kd, vd = k.to(torch.float64), v.to(torch.float64)
    w = torch.einsum("htd,hde,hte->ht", kd, key_target.to(torch.float64), kd)
    return torch.einsum("ht,htd,hte->hde", w, vd, vd), w.sum(dim=1)


def plain_moment(x: torch.Tensor) -> torch.Tensor:
    """``X^T X`` per head: ``x: [H, T, d]`` -> ``[H, d, d]`` float64 (the ablation's targets)."""
    xd = x.to(torch.float64)
    return xd.transpose(1, 2) @ xd


def attention_key_moment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    visible: torch.Tensor,
    quantized: torch.Tensor,
    *,
    chunk: int = 512,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys' metric weighted by what a key's score error costs the attention output.

    To first order a score error ``d_i`` of key ``i`` moves query ``n``'s output by
    ``p_ni (v_i - o_n) d_i`` (``p`` the softmax weights, ``o_n`` the output), so with
    independent errors ``E |d o_n|^2 = scaling^2 sum_i p_ni^2 |v_i - o_n|^2 (q_n . e_i)^2``
    (``e_i`` key ``i``'s error; ``scaling^2`` is common to all and left out). One metric
    shared by the keys is then ``sum_n w_n q_n^T q_n`` with ``w_n = sum_{i quantized}
    p_ni^2 |v_i - o_n|^2``: a query whose attention lies on exact (BF16 window) keys, or is
    spread thin, weighs little, where ``C_Q`` counts every query alike.

    ``q: [H*g, n, d]``: queries at ``n`` positions of one sequence; ``k, v: [H, T, d]``;
    ``visible: [n, T]`` bool, the keys each query attends to (causal); ``quantized: [n, T]``
    bool, those it reads quantized. Scores in ``dtype`` over ``chunk`` queries at a time, so
    memory stays ``O(chunk * T)``.

    Returns ``(sum_n w_n q_n^T q_n: [H, d, d], sum_n w_n: [H])`` float64 (their ratio is the
    metric, on the queries' scale).
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q must be [heads, n, d] and k, v [H, T, d], got {list(q.shape)}, "
            f"{list(k.shape)}, {list(v.shape)}"
        )
    h, t, d = k.shape
    n = q.shape[1]
    if q.shape[0] % h:
        raise ValueError(f"query heads ({q.shape[0]}) must be a multiple of KV heads ({h})")
    for name, m in (("visible", visible), ("quantized", quantized)):
        if m.dtype != torch.bool or tuple(m.shape) != (n, t):
            raise ValueError(
                f"{name} must be a [n={n}, T={t}] bool tensor, got {m.dtype} {list(m.shape)}"
            )
    if bool((quantized & ~visible).any()):
        raise ValueError("quantized must be a subset of visible (a query reads those keys)")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    g = q.shape[0] // h
    qg = q.to(dtype).reshape(h, g, n, d)
    kd, vd = k.to(dtype), v.to(dtype)
    v_norm2 = vd.square().sum(-1)  # [H, T]
    moment = torch.zeros(h, d, d, dtype=torch.float64, device=q.device)
    weight = torch.zeros(h, dtype=torch.float64, device=q.device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        s = torch.einsum("hgnd,htd->hgnt", qg[:, :, a:b], kd) * scaling
        p = torch.softmax(s.masked_fill(~visible[a:b], float("-inf")), dim=-1)
        p = torch.nan_to_num(p)  # a query that sees no key: no weight
        o = torch.einsum("hgnt,htd->hgnd", p, vd)
        # |v_i - o_n|^2 = |v_i|^2 - 2 v_i . o_n + |o_n|^2
        dist = v_norm2[:, None, None, :] - 2 * torch.einsum("hgnd,htd->hgnt", o, vd)
        dist = (dist + o.square().sum(-1, keepdim=True)).clamp_min(0)
        w = (p.square() * dist * quantized[a:b]).sum(-1).to(torch.float64)  # [H, g, chunk]
        x = qg[:, :, a:b].to(torch.float64) * w[..., None].sqrt()
        x = x.reshape(h, -1, d)
        moment += x.transpose(1, 2) @ x
        weight += w.sum(dim=(1, 2))
    return moment, weight


class LayerMoments:
    """Running float64 sums of every target of one layer (``H`` KV heads, ``d`` channels).

    ``key``, ``value``, ``proxy``, ``kk``, ``vv``: ``[H, d, d]`` sums; ``tokens`` counts query
    tokens x query heads per KV head (the divisor of ``key`` and ``value``), ``kv_tokens`` the
    K/V tokens (divisor of ``kk``, ``vv``), ``proxy_weight`` the proxy's ``sum_t w_t`` ``[H]``.
    """

    TARGETS = ("key", "value", "proxy", "kk", "vv")

    def __init__(self, num_kv_heads: int, head_dim: int) -> None:
        z = lambda: torch.zeros(num_kv_heads, head_dim, head_dim, dtype=torch.float64)  # noqa: E731
        self.key, self.value, self.proxy, self.kk, self.vv = z(), z(), z(), z(), z()
        self.proxy_weight = torch.zeros(num_kv_heads, dtype=torch.float64)
        self.tokens = 0
        self.kv_tokens = 0

    def add(
        self, q, k, v, scaling: float, *, chunk: int = 512, dtype=torch.float32, shifted=None
    ) -> None:
        """Add one sequence (``q: [H*g, T, d]``, ``k, v: [H, T, d]``): every target but the
        proxy. ``shifted``: ``(q', k')`` pairs of the same sequence at other positions
        (:func:`foscar.oscar.positions.shifted_views`); the key targets (``key``, ``kk``) then
        add their mean, so the sequence keeps its weight, and the value targets, which RoPE
        does not touch, read ``q, k``."""
        g = _check_qkv(q, k, v)
        views = [(q, k)] if shifted is None else list(shifted)
        for qs, ks in views:
            _check_qkv(qs, ks, v)
        n = len(views)
        self.key += (sum(query_moment(qs, k.shape[0]) for qs, _ in views) / n).cpu()
        self.value += score_weighted_value_moment(q, k, v, scaling, chunk=chunk, dtype=dtype).cpu()
        self.kk += (sum(plain_moment(ks) for _, ks in views) / n).cpu()
        self.vv += plain_moment(v).cpu()
        self.tokens += g * k.shape[1]
        self.kv_tokens += k.shape[1]

    def add_proxy(self, k, v, key_target: torch.Tensor) -> None:
        """Add one sequence to the proxy target; ``key_target`` is the final ``C_Q [H, d, d]``."""
        s, w = proxy_value_moment(k, v, key_target.to(k.device))
        self.proxy += s.cpu()
        self.proxy_weight += w.cpu()

    def target(self, name: str) -> torch.Tensor:
        """The normalised per-head target ``[H, d, d]`` (float64, symmetrised)."""
        if name not in self.TARGETS:
            raise ValueError(f"target must be one of {self.TARGETS}, got {name!r}")
        if name == "proxy":
            if not bool((self.proxy_weight > 0).all()):
                raise ValueError("the proxy target has no data (run the proxy pass first)")
            c = self.proxy / self.proxy_weight[:, None, None]
        else:
            n = self.tokens if name in ("key", "value") else self.kv_tokens
            if n == 0:
                raise ValueError("no calibration tokens were added")
            c = getattr(self, name) / n
        return (c + c.transpose(1, 2)) / 2
