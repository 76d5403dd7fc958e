"""Reference quantizers: per-token percentile clipping, min-max affine INT2/INT4, dequantization.

``x ~= s * q + z`` with ``s = max(max - min, 1e-8) / (2**bits - 1)``, ``z = min`` and
``q = clamp(floor((x - min) / s + 0.5), 0, 2**bits - 1)`` over each group, computed in fp32 with
IEEE division on every device
(OSCAR's released quantizer, oscar.md Sec. 3, written in foscar's ``x = s*q + z`` convention).
Clipping (``QuantFormat.clip = p``) clamps each token to ``[-tau, tau]`` first, with ``tau`` the
``min(floor(p*d), d-1)``-th smallest ``|x|`` of its ``d`` channels.

Shapes: token-wise groups quantize rows ``x: [..., D]`` into ``scale: [..., D/g]``; channel-wise
groups quantize ``x: [..., T, D]`` (``T`` a multiple of ``g``) into ``scale: [..., T/g, D]``.
"""

from __future__ import annotations

import torch

from .formats import GroupAxis, QuantFormat

__all__ = [
    "clip_per_token",
    "quantize",
    "quantize_gptq",
    "gptq_factor",
    "dequantize",
    "SCALE_FLOOR",
]

#: Smallest ``max - min`` a group may have, so that every scale is positive and finite.
SCALE_FLOOR = 1e-8


def clip_per_token(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp every row of ``x: [..., d]`` to ``[-tau, tau]``, ``tau`` its percentile of ``|x|``."""
    d = x.shape[-1]
    index = min(int(ratio * d), d - 1)
    tau = torch.kthvalue(x.abs(), index + 1, dim=-1, keepdim=True).values
    return torch.maximum(torch.minimum(x, tau), -tau)


def quantize(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` in ``fmt``; returns ``(codes uint8, scale fp32, offset fp32)`` (unfolded).

    Token-wise: ``x: [..., D]`` -> codes ``[..., D]``, scale/offset ``[..., D/g]``.
    Channel-wise: ``x: [..., T, D]`` with ``T % g == 0`` -> codes ``[..., T, D]``,
    scale/offset ``[..., T/g, D]``.
    """
    xf = x.to(torch.float32)
    if fmt.clip is not None:
        xf = clip_per_token(xf, fmt.clip)
    g = fmt.group_size
    if fmt.axis is GroupAxis.TOKEN:
        d = xf.shape[-1]
        grouped = xf.reshape(*xf.shape[:-1], d // g, g)
        reduce_dim = -1
    else:
        t, d = xf.shape[-2:]
        if t % g:
            raise ValueError(f"channel-wise groups need a multiple of {g} tokens, got {t}")
        grouped = xf.reshape(*xf.shape[:-2], t // g, g, d)
        reduce_dim = -2
    # + 0.0 makes a zero minimum +0 whichever of +0 / -0 the min picked (a clipped row whose
    # percentile is 0 holds both): the fused write stores the same bits (foscar.kernels)
    lo = grouped.amin(dim=reduce_dim, keepdim=True) + 0.0
    hi = grouped.amax(dim=reduce_dim, keepdim=True)
    span = (hi - lo).clamp_min(SCALE_FLOOR)
    # Divide by a device tensor, not a Python number: CUDA torch turns division by a CPU
    # scalar into multiplication by its reciprocal (not IEEE division), so the same values
    # quantized to other bits on a GPU than on a CPU (and than the fused decode write).
    scale = span / span.new_full((), fmt.levels)
    codes = torch.floor((grouped - lo) / scale + 0.5).clamp_(0, fmt.levels)
    codes = codes.reshape(xf.shape).to(torch.uint8)
    return codes, scale.squeeze(reduce_dim), lo.squeeze(reduce_dim)


def gptq_factor(hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """GPTQ's rounding factor of a Hessian ``[..., D, D]`` (symmetric, positive semi-definite):
    the upper Cholesky factor ``U`` of ``(hessian + damp * mean(diag) * I)^-1`` (float64), as
    :func:`quantize_gptq` takes it."""
    h = hessian.to(torch.float64)
    h = (h + h.transpose(-1, -2)) / 2
    d = h.shape[-1]
    eye = torch.eye(d, dtype=torch.float64, device=h.device)
    mean_diag = torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)[..., None, None]
    h = h + damp * mean_diag.clamp_min(1e-12) * eye
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def quantize_gptq(
    x: torch.Tensor, fmt: QuantFormat, factor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` of token-wise groups with GPTQ's rounding (Frantar et al., 2023) under a
    per-head metric: the same scale and offset (min-max of the clipped row), but the codes are
    chosen channel by channel, each rounding error fed forward into the channels not yet
    rounded, so that ``e^T H e`` (``e`` the row's error, ``H`` the metric whose
    :func:`gptq_factor` is ``factor``) is small rather than each ``|e_j|``. The feedback
    targets the unclipped row. The stored format is unchanged.

    ``x: [H, T, D]``; ``factor: [H, D, D]`` upper triangular (one per head of ``x``). With a
    diagonal ``factor`` the codes are :func:`quantize`'s.
    """
    if fmt.axis is not GroupAxis.TOKEN:
        raise ValueError(f"GPTQ rounding covers token-wise groups; the format is {fmt.short()}")
    if x.dim() != 3 or tuple(factor.shape) != (x.shape[0], x.shape[2], x.shape[2]):
        raise ValueError(
            f"factor must be [heads={x.shape[0]}, D, D] for x [H, T, D] = {list(x.shape)}, got "
            f"{list(factor.shape)}"
        )
    _, scale, lo = quantize(x, fmt)  # the clipped row's min-max scale and offset
    d, g = x.shape[-1], fmt.group_size
    # channel-major [D, H, T]: channel j of every row is one contiguous slice, so each step
    # reads and updates whole rows of memory (faster on a CPU than [H, T, D] with the same
    # elementwise operations, hence the same codes)
    w = x.to(torch.float32).movedim(-1, 0).contiguous()
    s_full = scale.repeat_interleave(g, dim=-1).movedim(-1, 0).contiguous()
    z_full = lo.repeat_interleave(g, dim=-1).movedim(-1, 0).contiguous()
    u = factor.to(device=x.device, dtype=torch.float32)
    diag = torch.diagonal(u, dim1=-2, dim2=-1).T.contiguous()  # [D, H]: u[h, j, j]
    feed = u.permute(1, 2, 0).contiguous()  # [D, D, H]: feed[j, k, h] = u[h, j, k]
    codes = torch.empty_like(w)
    for j in range(d):
        q = torch.floor((w[j] - z_full[j]) / s_full[j] + 0.5).clamp_(0, fmt.levels)
        codes[j] = q
        err = (w[j] - (q * s_full[j] + z_full[j])) / diag[j][:, None]
        w[j + 1 :] -= err[None] * feed[j, j + 1 :, :, None]
    return codes.to(torch.uint8).movedim(0, -1).contiguous(), scale, lo


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    fmt: QuantFormat,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``s * q + z`` elementwise, broadcasting each group's ``(s, z)`` over its values.

    Works with unfolded ``(s, z)`` on codes ``q`` or with folded ``(s', z')`` on operand values
    ``y`` (pass ``codes = operand_values(q)``): the arithmetic is the same.
    """
    g = fmt.group_size
    if fmt.axis is GroupAxis.TOKEN:
        s = scale.to(dtype).repeat_interleave(g, dim=-1)
        z = offset.to(dtype).repeat_interleave(g, dim=-1)
    else:
        s = scale.to(dtype).repeat_interleave(g, dim=-2)
        z = offset.to(dtype).repeat_interleave(g, dim=-2)
    return codes.to(dtype) * s + z
