"""OSCAR's rotation ``R = U * H * P_br`` (oscar.md Sec. 2), and its ablations.

For a target covariance ``C`` ([d, d], symmetric, positive semi-definite):

* ``U``: eigenvectors of ``C`` as columns, eigenvalues in descending order, so that
  ``U^T C U = diag(lambda_1 >= ... >= lambda_d)``;
* ``H``: the normalised Sylvester Walsh-Hadamard matrix of size ``d`` (``H H^T = I``); it
  flattens the diagonal, every diagonal entry of ``(UH)^T C (UH)`` equals ``tr(C) / d``;
* ``P_br``: the bit-reversal permutation of the column indices: column ``j`` of ``R`` is column
  ``br(j)`` of ``U H`` (for ``d = 128``, output columns 0, 1, 2, 3 take columns 0, 64, 32, 96),
  so the largest directions land in different quantization groups for any power-of-two group
  size; a no-op on the quantized values when one group spans all ``d`` channels.

Row vectors are rotated on the right: ``k' = k R_K``, ``q' = q R_K`` (so ``q' . k' = q . k``),
``v' = v R_V`` and the attention output ``o = o' R_V^T``. ``d`` must be a power of two (the
Hadamard matrix and the bit reversal need it). Everything is float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "RotationRecipe",
    "RECIPES",
    "hadamard",
    "bit_reversal",
    "eigenbasis",
    "rotation",
    "check_head_dim",
]


def check_head_dim(head_dim: int, name: str = "head_dim") -> int:
    """Raise ``ValueError`` naming ``name`` unless it is a power of two >= 2."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise ValueError(f"{name} must be a power-of-two int, got {head_dim!r}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(
            f"{name} must be a power of two >= 2 (Hadamard and bit reversal need one), "
            f"got {head_dim}"
        )
    return head_dim


def hadamard(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Walsh-Hadamard matrix ``[d, d]``: ``H[i, j] = (-1)^popcount(i & j)
    / sqrt(d)``; symmetric and orthogonal."""
    check_head_dim(d, "d")
    i = torch.arange(d)
    bits = (i.unsqueeze(1) & i.unsqueeze(0)).to(torch.int64)
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype) / d**0.5


def bit_reversal(d: int) -> torch.Tensor:
    """``br[j]``: ``j`` with its ``log2(d)`` bits reversed (LongTensor ``[d]``, an involution)."""
    check_head_dim(d, "d")
    n = d.bit_length() - 1
    return torch.tensor([int(format(j, f"0{n}b")[::-1], 2) for j in range(d)], dtype=torch.long)


def eigenbasis(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, lambda)`` of a symmetric ``c: [..., d, d]``, eigenvalues descending, in float64.

    ``c`` is symmetrised first (accumulated sums are symmetric only up to rounding).
    """
    c = c.to(torch.float64)
    c = (c + c.transpose(-1, -2)) / 2
    lam, u = torch.linalg.eigh(c)  # ascending
    return u.flip(-1), lam.flip(-1)


@dataclass(frozen=True)
class RotationRecipe:
    """Which factors of ``R = U * H * P_br`` to use (the paper's ablations switch them off)."""

    use_u: bool = True
    use_h: bool = True
    use_br: bool = True

    @property
    def name(self) -> str:
        if self.use_u and self.use_h and self.use_br:
            return "full"
        parts = [n for n, on in (("U", self.use_u), ("H", self.use_h), ("Pbr", self.use_br)) if on]
        return "*".join(parts) if parts else "identity"


#: the rotations of the paper's ablation table (oscar.md Sec. 6), and Hadamard alone (QuaRot)
RECIPES = {
    "full": RotationRecipe(),
    "no-br": RotationRecipe(use_br=False),
    "no-h": RotationRecipe(use_h=False),
    "no-u": RotationRecipe(use_u=False),
    "none": RotationRecipe(False, False, False),
    "hadamard": RotationRecipe(use_u=False, use_br=False),
}


def rotation(c: torch.Tensor | None, recipe: RotationRecipe = RotationRecipe()) -> torch.Tensor:
    """``R = U * H * P_br`` of a target covariance ``c: [..., d, d]``, float64 ``[..., d, d]``.

    Without ``U`` only the shape of ``c`` is read. ``R`` is orthogonal.
    """
    if c is None:
        raise ValueError("c must be a [..., d, d] tensor (its size fixes d even without U)")
    if c.dim() < 2 or c.shape[-1] != c.shape[-2]:
        raise ValueError(f"c must be a square matrix [..., d, d], got {list(c.shape)}")
    d = check_head_dim(int(c.shape[-1]), "head_dim")
    eye = torch.eye(d, dtype=torch.float64).expand(c.shape)
    r = eigenbasis(c)[0] if recipe.use_u else eye.clone()
    if recipe.use_h:
        r = r @ hadamard(d)
    if recipe.use_br:
        r = r[..., bit_reversal(d)]
    return r.contiguous()
