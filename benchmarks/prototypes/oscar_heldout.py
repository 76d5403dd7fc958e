"""The offline INT2-key measure that the OSCAR key prototypes share, from session 20 on.

Earlier prototypes (oscar_gptq_refine, oscar_learned_rotation, ...) each carry their own
copy, kept as the records of what ran. Their numbers equal this module's. The measure:
- calibration: 4 x 2,048 tokens of CPython's language reference at the RoPE shifts of 0-8K;
  per layer and KV head, the queries' covariance C_Q (pooled over the KV head's query heads),
  the keys' K^T K and the queries' mean;
- held out: the FOSCAR paper, 2 x 4,096 tokens from token 256, 64 queries spread over the
  last 512 positions, BF16 64/256 windows exact, values exact;
- error: the relative attention-output error at the best clip of :data:`CLIPS`, per layer,
  for the rotations U*H*P_br ("full") and H*P_br ("no-u") of K^T K per KV head, and "select",
  the better of the two in each layer.
"""

from __future__ import annotations

import torch

from foscar.eval import texts
from foscar.oscar.calibrate import _causal_attention, _rotate, _window_mask, default_sequences
from foscar.oscar.capture import capture_attention, model_shapes
from foscar.oscar.positions import position_shifts, shifted_views
from foscar.oscar.rotation import RECIPES, rotation

CLIPS = (1.0, 0.96, 0.92, 0.88, 0.85)
WINDOWS = (64, 256)
NUM_QUERIES = 64
ROTATIONS = ("full", "no-u")


def sym(c: torch.Tensor) -> torch.Tensor:
    return (c + c.transpose(-1, -2)) / 2


def calibration_statistics(model, tok) -> dict[str, torch.Tensor]:
    """``{"qq": [L, H, d, d], "kk": [L, H, d, d], "mean_q": [L, H, d]}`` (float64) over the
    calibration text at positions 0-8K."""
    shapes = model_shapes(model)
    n_layers, n_kv, d = shapes["num_layers"], shapes["num_kv_heads"], shapes["head_dim"]
    views = shifted_views(model, position_shifts(2048, 8192))
    qq = torch.zeros(n_layers, n_kv, d, d, dtype=torch.float64)
    kk = torch.zeros_like(qq)
    qsum = torch.zeros(n_layers, n_kv, d, dtype=torch.float64)
    qcount = torch.zeros(n_layers, dtype=torch.float64)

    def accumulate(layer, q, k, v, scaling):
        g = q.shape[0] // n_kv
        for qv, kv in views(q, k):
            qs = qv.double().reshape(n_kv, -1, d)
            qq[layer] += (qs.transpose(1, 2) @ qs) / g
            qsum[layer] += qs.sum(1) / g
            qcount[layer] += qs.shape[1] / g
            kk[layer] += kv.double().transpose(1, 2) @ kv.double()

    with capture_attention(model, accumulate):
        for s in default_sequences(tok, 8192, 2048, texts.python_reference().text):
            model(input_ids=s[None], use_cache=False, logits_to_keep=1)
    return {"qq": qq, "kk": kk, "mean_q": qsum / qcount[:, None, None]}


def key_rotations(stats: dict[str, torch.Tensor], name: str, layer: int) -> tuple:
    """``(R [H, d, d], metric H = R^T C_Q R [H, d, d])`` (float64) of rotation ``name`` in
    ``layer``."""
    r = rotation(sym(stats["kk"][layer]), RECIPES[name])
    return r, sym(r.transpose(-1, -2) @ sym(stats["qq"][layer]) @ r)


def held_out(tok) -> list[torch.Tensor]:
    """The two held-out token sequences."""
    ids = tok(texts.paper().text, return_tensors="pt").input_ids[0]
    return [ids[256 : 256 + 4096], ids[256 + 4096 : 256 + 8192]]


def query_positions(length: int) -> torch.Tensor:
    """The held-out queries' positions in a sequence of ``length`` tokens."""
    return torch.linspace(length - 512, length - 1, NUM_QUERIES).round().long()


def rotated_layer(q, k, v, r: torch.Tensor, scaling: float) -> dict[str, torch.Tensor]:
    """One layer's held-out capture in rotation ``r [H, d, d]``: the queries' ``positions``,
    the BF16 ``window`` mask, the rotated queries ``qs`` there, the rotated keys in BF16
    (``kr``) and fp32 (``x``), the values in BF16 as fp32 (``vb``), and the ``exact``
    attention output (V exact, keys unquantized)."""
    t = k.shape[1]
    positions = query_positions(t)
    qs = _rotate(q[:, positions], r)
    kr = _rotate(k, r).to(torch.bfloat16)
    x, vb = kr.float(), v.to(torch.bfloat16).float()
    return {
        "positions": positions,
        "window": _window_mask(positions, t, WINDOWS),
        "qs": qs,
        "kr": kr,
        "x": x,
        "vb": vb,
        "exact": _causal_attention(qs, x, vb, positions, scaling),
    }


def best_clip_errors(err: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``[L]``: relative error at the best clip from summed squared errors ``err [L, clips]``
    and the exact outputs' summed squares ``norm [L]``."""
    return (err / norm[:, None]).sqrt().min(1).values


def select(per_rotation: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[L]``: the better of the rotations' per-layer errors."""
    return torch.minimum(per_rotation["full"], per_rotation["no-u"])
