"""OSCAR's per-layer transforms as the cache applies them: rotations of what a layer stores,
clip ratios of its history, GPTQ rounding of its keys.

A layer may store ``k R_K`` and ``v R_V`` (rows; ``R`` orthogonal, one per layer or per KV
head) in every segment; :func:`foscar.decode_attention` rotates the queries by ``R_K`` and the
output by ``R_V^T``, so attention is unchanged in exact arithmetic. Shapes: ``H`` KV heads,
``D`` head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..formats import GroupAxis, KVFormat, QuantFormat

__all__ = ["LayerTransform", "rotate_rows", "make_transform", "history_format"]


@dataclass(frozen=True)
class LayerTransform:
    """OSCAR's transform of one layer (:meth:`QuantizedKVCache.set_transform`).

    ``key_rotation, value_rotation``: ``[H, D, D]`` float64 orthogonal (one per KV head) or None;
    ``key_clip, value_clip``: clip ratio replacing the format's for this layer's history, or None;
    ``key_gptq``: ``[H, D, D]`` float32 upper-triangular GPTQ factor of the keys' metric (the
    queries' covariance in the stored basis; :func:`foscar.quantize.gptq_factor`), or None for
    round-to-nearest.
    """

    key_rotation: torch.Tensor | None = None
    value_rotation: torch.Tensor | None = None
    key_clip: float | None = None
    value_clip: float | None = None
    key_gptq: torch.Tensor | None = None
    # what is derived from the fields once, not per call: the rotations in float32 (a decode
    # step rotates K, V, Q and the output of every layer) and the clipped history formats
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def rotate(self, x: torch.Tensor, role: str, *, inverse: bool = False) -> torch.Tensor:
        """:func:`rotate_rows` of ``x`` by this layer's ``role`` ("key" or "value") rotation
        (float32 ``x`` and narrower with the rotation's float32 copy, made once)."""
        r = getattr(self, f"{role}_rotation")
        if x.dtype != torch.float64:
            r = self.float32_rotation(role)
        return rotate_rows(x, r, inverse=inverse)

    def float32_rotation(self, role: str) -> torch.Tensor:
        """The ``role`` ("key" or "value") rotation ``[H, D, D]`` in float32, converted at the
        first call and the same tensor from then on."""
        key = ("float32", role)
        if key not in self._derived:
            self._derived[key] = getattr(self, f"{role}_rotation").to(torch.float32)
        return self._derived[key]


def rotate_rows(x: torch.Tensor, r: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """``x R_h`` (or ``x R_h^T`` with ``inverse``) for rows ``x: [..., Hx, D]`` of heads ``Hx``.

    ``r: [H, D, D]``; head ``j`` of ``x`` uses ``R_{j // (Hx / H)}`` (query heads share their
    KV head's rotation). Computed in float64 for float64 ``x``, else float32; returned in that
    dtype (the cache rounds to its window dtype afterwards). One matrix product (batched over
    the heads when there are several rotations): ``einsum`` planned the same product again on
    the host at every call.
    """
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    rr = r.to(device=x.device, dtype=dt)  # no copy when it already is
    if inverse:
        rr = rr.transpose(-1, -2)
    h, (hx, d) = rr.shape[0], x.shape[-2:]
    if hx % h or rr.shape[-2:] != (d, d):
        raise ValueError(
            f"rotate_rows: x has {hx} heads of {d} channels, r is {list(r.shape)} (the heads "
            "must be a multiple of its rotations, each D x D)"
        )
    xg = x.to(dt).reshape(-1, h, hx // h, d)  # [N, H, g, D]
    if h == 1:
        return (xg.reshape(-1, d) @ rr[0]).reshape(x.shape)
    y = torch.bmm(xg.transpose(0, 1).reshape(h, -1, d), rr)  # [H, N * g, D]
    return y.unflatten(1, (-1, hx // h)).transpose(0, 1).reshape(x.shape)


def make_transform(
    fmt: KVFormat,
    layer: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    *,
    key_rotation=None,
    value_rotation=None,
    key_clip=None,
    value_clip=None,
    key_gptq=None,
) -> LayerTransform:
    """The checked :class:`LayerTransform` of ``layer`` (format ``fmt``) from
    :meth:`QuantizedKVCache.set_transform`'s arguments; raises naming the argument."""
    rotations = []
    for name, r in (("key_rotation", key_rotation), ("value_rotation", value_rotation)):
        if r is None:
            rotations.append(None)
            continue
        r = _per_head_matrices(name, r, torch.float64, num_kv_heads, head_dim, device)
        eye = torch.eye(head_dim, dtype=torch.float64, device=device)
        err = float((r.transpose(1, 2) @ r - eye).abs().max())
        if not err < 1e-6:
            raise ValueError(f"{name} must be orthogonal (max |R^T R - I| = {err:.2e})")
        rotations.append(r)
    clips = []
    for name, c in (("key_clip", key_clip), ("value_clip", value_clip)):
        if c is not None:
            # QuantFormat checks the ratio and names it; report our argument's name
            try:
                c = QuantFormat(clip=c).clip
            except (TypeError, ValueError) as e:
                raise type(e)(str(e).replace("clip", name, 1)) from None
        clips.append(c)
    if key_gptq is not None:
        if fmt.key.axis is not GroupAxis.TOKEN:
            raise ValueError(
                f"key_gptq: GPTQ rounding covers token-wise keys; layer {layer}'s keys are "
                f"{fmt.key.short()}"
            )
        key_gptq = _per_head_matrices(
            "key_gptq", key_gptq, torch.float32, num_kv_heads, head_dim, device
        )
        diag = torch.diagonal(key_gptq, dim1=-2, dim2=-1)
        if not bool(torch.equal(key_gptq, key_gptq.triu())) or not bool((diag > 0).all()):
            raise ValueError("key_gptq must be upper triangular with a positive diagonal")
    return LayerTransform(*rotations, *clips, key_gptq)


def _per_head_matrices(name: str, m, dtype, num_kv_heads: int, head_dim: int, device):
    """``m`` as ``[num_kv_heads, D, D]`` on ``device`` in ``dtype``, from a floating ``[D, D]``,
    ``[1, D, D]`` (shared by the KV heads) or ``[H, D, D]`` tensor; raises naming the argument
    ``name`` otherwise."""
    h, d = num_kv_heads, head_dim
    if not isinstance(m, torch.Tensor) or not m.is_floating_point():
        raise TypeError(f"{name} must be a floating torch.Tensor, got {type(m).__name__}")
    if tuple(m.shape) in ((d, d), (1, d, d)):
        m = m.expand(h, d, d)
    if tuple(m.shape) != (h, d, d):
        raise ValueError(
            f"{name} must be [head_dim={d}, {d}] or [num_kv_heads={h}, {d}, {d}], "
            f"got {list(m.shape)}"
        )
    return m.to(device=device, dtype=dtype).contiguous()


def history_format(transform: LayerTransform, f: QuantFormat, name: str) -> QuantFormat:
    """The QuantFormat ``f`` of role ``name`` ("k" or "v") with the layer's clip ratio, if any."""
    clip = transform.key_clip if name == "k" else transform.value_clip
    if clip is None:
        return f
    # a decode step asks ~4 times per layer; replace() validates the format each time.
    # (The memo lives on the transform: only the cache's set_transform makes its transforms,
    # and a layer's format never changes; keyed by the format too, to stay right if not.)
    key = ("format", name, f)
    if key not in transform._derived:
        transform._derived[key] = replace(f, clip=clip)
    return transform._derived[key]
