"""Quantized KV formats: bit widths, group axes, operand mappings and the packed-word layout.

A stored value is ``x = s * q + z`` with ``q`` in ``0 .. 2**bits - 1`` and one fp32 scale ``s``
and offset ``z`` per group of ``group_size`` values. A group is either **token-wise** (``g``
consecutive channels of one token) or **channel-wise** (``g`` consecutive tokens of one channel);
K and V choose independently.

Operand mappings (design.md, paper Table 1). A matrix unit never sees ``q`` itself but an operand
``y = alpha * q + beta`` built from the packed bits by shifts and masks alone:

============  ============  ===============================  ===========  ==================
mapping       bits          bit construction per lane        y            (alpha, beta)
============  ============  ===============================  ===========  ==================
``bf16``      2, 4          ``0x4300 | q`` (mantissa inj.)   ``q + 128``  (1, 128)
``e4m3``      2, 4          ``q`` in the low bits of a byte  ``q/512``    (2**-9, 0)
``e2m1``      2             ``q`` in the low bits of a nibble ``q/2``     (1/2, 0)
============  ============  ===============================  ===========  ==================

The cache stores the *folded* constants ``s' = s / alpha`` and ``z' = z - beta * s'`` (paper
Eq. 5), so that ``x = s' * y + z'`` and kernels never touch ``alpha`` or ``beta``.

Packed-word layout (the one place it is defined)
------------------------------------------------
Each row of ``head_dim`` codes (one token of one KV head) is packed into
``head_dim * bits // 32`` little-endian 32-bit words. A mapping's operand is ``lane_bits`` wide
(16 for bf16, 8 for e4m3, 4 for e2m1); a word holds ``nl = 32 // lane_bits`` lanes, and each lane
holds ``lane_bits // bits`` fields of ``bits`` bits. Value ``i`` of word ``w`` (channel
``c = w * (32 // bits) + i``) sits at

    bit(i) = lane_bits * (i % nl) + bits * (i // nl)

so the ``k``-th extraction ``u_k = (w >> (bits * k)) & lane_mask`` (then ``| lane_base``) yields,
in lanes ``0 .. nl-1``, the operands of ``nl`` *consecutive* channels ``w*V + k*nl + j``.
For bf16 this is design.md's rule: the two values of a bf16 pair (channels ``2k``, ``2k+1`` of
the word) lie 16 bits apart and ``((w >> 2k) & 0x00030003) | 0x43004300`` (INT2) or
``((w >> 4k) & 0x000F000F) | 0x43004300`` (INT4) builds both in one shift and one LOP3.
For e4m3/e2m1 it is the paper's Appendix A.2 layout (``w & 0x33333333``, ``(w >> 2) &
0x33333333`` for INT2 in E2M1; ``w & 0x0F0F0F0F``, ``(w >> 4) & 0x0F0F0F0F`` for INT4 in E4M3).

Channel order. Which channel sits at value position ``p = w * (32 // bits) + i`` is a
permutation chosen per role so that each thread of the Hopper kernels owns whole words of its
wgmma register fragment (m64 x k16 bf16, kWidth 2: thread ``(warp, lane)`` holds rows
``lane//4 + 8*i + 16*warp`` and columns ``16*kb + 8*i' + 2*(lane%4) + j``):

* K (A operand of ``S^T = K Q^T``: rows tokens, columns channels). With ``U = words/4`` and
  ``PAIRS = 16 // bits``, channel ``c`` (``j = c%2, T = (c//2)%4, r = c//8``) lives in word
  ``T*U + r//PAIRS`` at bit ``bits*(r%PAIRS) + 16*j``.
* V (A operand of ``O^T = V^T P``: rows channels, columns token pairs). A *piece* of
  ``PB = bits*D/32`` bits holds the channels ``g + 8a + 16w + 64b`` of one ``(w, g)``; channel
  ``c`` (``g = c%8, a = (c//8)%2, w = (c//16)%4, b = c//64``) lives in piece ``8w + g``, i.e.
  word ``(8w+g) // (32/PB)`` at bit ``((8w+g) % (32/PB))*PB + bits*(2b + a)``. The kernel joins
  the same piece of two consecutive tokens with one PRMT.

These orders apply to the bf16 mapping when ``head_dim`` is a multiple of 64 up to 256 (K: and
``head_dim*bits`` a multiple of 128); otherwise, and for e4m3/e2m1, channels are in natural order.
``tests/test_formats.py`` pins every layout bit-exactly.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

__all__ = [
    "GroupAxis",
    "OperandMapping",
    "QuantFormat",
    "KVFormat",
    "SUPPORTED_BITS",
    "pack_codes",
    "unpack_codes",
    "build_operands",
    "operand_values",
    "fold_scale_offset",
    "words_per_row",
    "bit_offsets",
    "Role",
    "channel_order",
    "kernel_bit_location",
]

SUPPORTED_BITS = (2, 4)
_STANDARD_GROUP_SIZES = (32, 64, 128)


class GroupAxis(str, enum.Enum):
    """Which values share one scale and offset."""

    TOKEN = "token"  # g consecutive channels of one token
    CHANNEL = "channel"  # g consecutive tokens of one channel

    def __str__(self) -> str:  # "token", not "GroupAxis.TOKEN", in messages and tables
        return self.value


class OperandMapping(str, enum.Enum):
    """How packed codes become matrix-unit operands (paper Table 1)."""

    BF16 = "bf16"  # Hopper: mantissa injection, y = q + 128
    E4M3 = "e4m3"  # FP8 E4M3 with q in the mantissa bits, y = q * 2**-9
    E2M1 = "e2m1"  # FP4 E2M1 (INT2 only), y = q / 2

    def __str__(self) -> str:
        return self.value

    @property
    def lane_bits(self) -> int:
        return {OperandMapping.BF16: 16, OperandMapping.E4M3: 8, OperandMapping.E2M1: 4}[self]

    @property
    def lane_base(self) -> int:
        """The fixed bit pattern OR-ed into every lane (0x4300 for bf16 mantissa injection)."""
        return 0x4300 if self is OperandMapping.BF16 else 0

    def alpha_beta(self, bits: int) -> tuple[float, float]:
        """``(alpha, beta)`` with ``y = alpha * q + beta``."""
        self.check_bits(bits)
        if self is OperandMapping.BF16:
            return 1.0, 128.0
        if self is OperandMapping.E4M3:
            return 2.0**-9, 0.0
        return 0.5, 0.0

    def check_bits(self, bits: int) -> None:
        if self is OperandMapping.E2M1 and bits != 2:
            raise ValueError(f"mapping 'e2m1' holds only INT2 codes, got bits={bits}")


def _check_bits(bits: int, name: str = "bits") -> None:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in {SUPPORTED_BITS}, got {bits!r}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits}")


@dataclass(frozen=True)
class QuantFormat:
    """How one of K or V is quantized.

    Parameters
    ----------
    bits : 2 or 4
    axis : ``"token"`` (groups of ``group_size`` channels of one token) or ``"channel"``
        (groups of ``group_size`` tokens of one channel).
    group_size : 32, 64, 128 or the head dimension.
    clip : ``None`` for min-max quantization, or the per-token percentile ``p`` in ``(0, 1]`` of
        OSCAR's clipping (oscar.md Sec. 3): ``tau = sort(|x|)[min(floor(p*d), d-1)]`` over the
        ``d`` channels of each token, and ``x`` is clamped to ``[-tau, tau]`` before quantizing.
    """

    bits: int = 2
    axis: GroupAxis = GroupAxis.TOKEN
    group_size: int = 128
    clip: float | None = None

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        try:
            object.__setattr__(self, "axis", GroupAxis(self.axis))
        except ValueError:
            raise ValueError(f"axis must be 'token' or 'channel', got {self.axis!r}") from None
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or g & (g - 1):
            raise ValueError(f"group_size must be a positive power of two, got {g!r}")
        if self.clip is not None:
            if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)):
                raise TypeError(f"clip must be None or a float in (0, 1], got {self.clip!r}")
            if not 0.0 < float(self.clip) <= 1.0:
                raise ValueError(f"clip must be in (0, 1], got {self.clip}")
            object.__setattr__(self, "clip", float(self.clip))

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def check_head_dim(self, head_dim: int, *, name: str = "format") -> None:
        """Raise ``ValueError`` unless this format can store rows of ``head_dim`` channels."""
        if head_dim % 16 or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive multiple of 16, got {head_dim}")
        g = self.group_size
        if g not in _STANDARD_GROUP_SIZES and g != head_dim:
            raise ValueError(
                f"{name}.group_size must be one of {_STANDARD_GROUP_SIZES} or head_dim "
                f"({head_dim}), got {g}"
            )
        if self.axis is GroupAxis.TOKEN and head_dim % g:
            raise ValueError(
                f"head_dim ({head_dim}) must be divisible by {name}.group_size ({g}) "
                "for token-wise groups"
            )

    def short(self) -> str:
        clip = "" if self.clip is None else f"c{self.clip:g}"
        return f"i{self.bits}{self.axis.value[0]}{self.group_size}{clip}"


@dataclass(frozen=True)
class KVFormat:
    """A complete cache format: K and V quantization, operand mapping, BF16 windows.

    Parameters
    ----------
    key, value : QuantFormat for K and V (chosen independently).
    mapping : operand mapping the folded constants are computed for (``"bf16"`` for Hopper).
    sink_tokens : the first ``sink_tokens`` tokens of a sequence stay in BF16 (OSCAR's sink).
    recent_tokens : the last ``recent_tokens`` tokens stay in BF16 (OSCAR's recent window);
        older tokens are demoted into the quantized history as the window slides.
    """

    key: QuantFormat = QuantFormat()
    value: QuantFormat = QuantFormat()
    mapping: OperandMapping = OperandMapping.BF16
    sink_tokens: int = 0
    recent_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("key", "value"):
            if not isinstance(getattr(self, name), QuantFormat):
                raise TypeError(
                    f"{name} must be a QuantFormat, got {type(getattr(self, name)).__name__}"
                )
        try:
            object.__setattr__(self, "mapping", OperandMapping(self.mapping))
        except ValueError:
            raise ValueError(
                f"mapping must be one of {[m.value for m in OperandMapping]}, got {self.mapping!r}"
            ) from None
        self.mapping.check_bits(self.key.bits)
        self.mapping.check_bits(self.value.bits)
        for name in ("sink_tokens", "recent_tokens"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be a non-negative int, got {n!r}")

    def check_head_dim(self, head_dim: int) -> None:
        self.key.check_head_dim(head_dim, name="key")
        self.value.check_head_dim(head_dim, name="value")

    @property
    def demotion_quantum(self) -> int:
        """Tokens demoted from the BF16 tail into the quantized history at a time.

        1 when both K and V are token-wise; otherwise the largest channel-wise group size, so
        that a channel-wise group is quantized only when its ``g`` tokens are complete. K and V
        share one history length, so a token-wise tensor paired with a channel-wise one waits
        for the group too (its BF16 tail is at most ``g - 1`` tokens longer than it needs).
        """
        channel = [f.group_size for f in (self.key, self.value) if f.axis is GroupAxis.CHANNEL]
        return max(channel, default=1)

    @property
    def tail_capacity(self) -> int:
        """BF16 tail slots a sequence needs: the recent window plus one demotion quantum."""
        return self.recent_tokens + self.demotion_quantum

    def short(self) -> str:
        s = f"K{self.key.short()}-V{self.value.short()}"
        if self.sink_tokens or self.recent_tokens:
            s += f"-w{self.sink_tokens}+{self.recent_tokens}"
        if self.mapping is not OperandMapping.BF16:
            s += f"-{self.mapping.value}"
        return s


def words_per_row(head_dim: int, bits: int) -> int:
    """32-bit words holding one row of ``head_dim`` codes."""
    _check_bits(bits)
    if (head_dim * bits) % 32:
        raise ValueError(f"head_dim * bits must be a multiple of 32, got {head_dim} * {bits}")
    return head_dim * bits // 32


def bit_offsets(bits: int, mapping: OperandMapping, device=None) -> torch.Tensor:
    """``bit(i)`` of the layout above for the ``32 // bits`` values of a word, as int64.

    Computed on ``device`` (no host-to-device copy, so no stream sync on a GPU)."""
    lane_bits = mapping.lane_bits
    lanes = 32 // lane_bits
    i = torch.arange(32 // bits, dtype=torch.int64, device=device)
    return lane_bits * (i % lanes) + bits * (i // lanes)


class Role(str, enum.Enum):
    """Which operand a packed row feeds: K (``S = Q K^T``) or V (``O = P V``)."""

    KEY = "key"
    VALUE = "value"


def kernel_bit_location(
    role: Role | str, channel: int, head_dim: int, bits: int
) -> tuple[int, int]:
    """``(word, bit)`` of ``channel`` in the Hopper kernels' layout (module docstring)."""
    role = Role(role)
    c = channel
    if role is Role.KEY:
        u_per_t = head_dim * bits // 32 // 4
        pairs = 16 // bits
        j, t, r = c % 2, (c // 2) % 4, c // 8
        return t * u_per_t + r // pairs, bits * (r % pairs) + 16 * j
    piece_bits = bits * head_dim // 32
    per_word = 32 // piece_bits
    g, a, w, b = c % 8, (c // 8) % 2, (c // 16) % 4, c // 64
    piece = 8 * w + g
    return piece // per_word, (piece % per_word) * piece_bits + bits * (2 * b + a)


def has_kernel_order(role: Role | str, head_dim: int, bits: int) -> bool:
    """Whether the Hopper kernel layout exists for this row shape (module docstring)."""
    if Role(role) is Role.KEY:
        return head_dim % 16 == 0 and (head_dim * bits) % 128 == 0
    return head_dim % 64 == 0 and head_dim <= 256


def channel_order(
    role: Role | str, bits: int, head_dim: int, mapping: OperandMapping | str = "bf16"
) -> torch.Tensor:
    """Permutation ``order[p] = channel`` of the packed value positions (module docstring).

    Returns a LongTensor ``[head_dim]``; the identity where no kernel layout applies.
    """
    mapping = OperandMapping(mapping)
    if mapping is not OperandMapping.BF16 or not has_kernel_order(role, head_dim, bits):
        return torch.arange(head_dim)
    return torch.tensor(_kernel_order(Role(role), bits, head_dim, mapping), dtype=torch.long)


@functools.cache
def _kernel_order(role: Role, bits: int, head_dim: int, mapping: OperandMapping) -> tuple:
    """:func:`channel_order` as a tuple, computed once per row shape (every cache write
    packs with it; the loop runs in Python)."""
    per_word = 32 // bits
    position_of_bit = {int(b): i for i, b in enumerate(bit_offsets(bits, mapping))}
    order = [0] * head_dim
    for c in range(head_dim):
        word, bit = kernel_bit_location(role, c, head_dim, bits)
        order[word * per_word + position_of_bit[bit]] = c
    return tuple(order)


def pack_codes(
    codes: torch.Tensor,
    bits: int,
    mapping: OperandMapping | str = "bf16",
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack codes along the last axis into int32 words (layout in the module docstring).

    codes: [..., head_dim] integer tensor with values in ``0 .. 2**bits - 1``.
    order: optional ``[head_dim]`` channel order (:func:`channel_order`); natural if omitted.
    Returns words: [..., head_dim * bits // 32] int32 (bit patterns; the sign bit is just a bit).
    """
    mapping = OperandMapping(mapping)
    mapping.check_bits(bits)
    if order is not None:
        codes = codes[..., order.to(codes.device)]
    head_dim = codes.shape[-1]
    nw = words_per_row(head_dim, bits)
    per_word = 32 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], nw, per_word)
    shifts = bit_offsets(bits, mapping, codes.device).to(torch.int32)
    # The fields are disjoint, so their sum is their OR (no carries; int32 wraps two's
    # complement, so bit 31 is just a bit).
    return (c << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_codes(
    words: torch.Tensor,
    bits: int,
    mapping: OperandMapping | str = "bf16",
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: words [..., W] int32 -> codes [..., W * 32 // bits] uint8."""
    mapping = OperandMapping(mapping)
    mapping.check_bits(bits)
    if order is not None:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return unpack_codes(words, bits, mapping)[..., inverse.to(words.device)]
    w = words.to(torch.int32)
    mask = (1 << bits) - 1
    offsets = [int(b) for b in bit_offsets(bits, mapping)]
    # int32 shifts are arithmetic, but the mask keeps only the field's own bits. One op per field
    # with a Python shift amount (torch's tensor-by-tensor shift is slower on the CPU), each
    # written straight into the uint8 result (stacking int32 fields was slower).
    codes = torch.empty(*w.shape, len(offsets), dtype=torch.uint8, device=w.device)
    for j, b in enumerate(offsets):
        codes[..., j] = (w >> b) & mask
    return codes.reshape(*words.shape[:-1], -1)


def build_operands(words: torch.Tensor, bits: int, mapping: OperandMapping | str = "bf16"):
    """The kernels' bit-level operand construction, in torch (for tests and documentation).

    words: [..., W] int32. Returns u: [..., W, lane_bits // bits] int32 where
    ``u[..., w, k] = ((words[..., w] >> (bits * k)) & lane_mask) | lane_base_word``: one shift
    and one masked merge per register. Each register holds ``32 // lane_bits`` operands of
    consecutive channels (lane ``j`` of ``u[..., w, k]`` is channel ``w*32//bits + k*nl + j``).
    """
    mapping = OperandMapping(mapping)
    mapping.check_bits(bits)
    lane_bits = mapping.lane_bits
    lanes = 32 // lane_bits
    lane_mask = sum(((1 << bits) - 1) << (lane_bits * j) for j in range(lanes))
    lane_base = sum(mapping.lane_base << (lane_bits * j) for j in range(lanes))
    w = words.to(torch.int64) & 0xFFFFFFFF
    k = torch.arange(lane_bits // bits, dtype=torch.int64, device=words.device)
    u = ((w.unsqueeze(-1) >> (bits * k)) & lane_mask) | lane_base
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def operand_values(
    codes: torch.Tensor,
    bits: int,
    mapping: OperandMapping | str = "bf16",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The operand value ``y = alpha * q + beta`` the matrix unit sees (exact in fp32 and fp64)."""
    mapping = OperandMapping(mapping)
    alpha, beta = mapping.alpha_beta(bits)
    return codes.to(dtype) * alpha + beta


def fold_scale_offset(
    scale: torch.Tensor, offset: torch.Tensor, bits: int, mapping: OperandMapping | str = "bf16"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paper Eq. 5: ``s' = s / alpha``, ``z' = z - beta * s'``, in fp32.

    With these, ``x = s * q + z = s' * y + z'`` for ``y = alpha * q + beta``. ``alpha`` is a
    power of two, so ``s'`` is exact; ``z'`` rounds once in fp32, and every reference and kernel
    reads the same stored ``z'``.
    """
    mapping = OperandMapping(mapping)
    alpha, beta = mapping.alpha_beta(bits)
    s = scale.to(torch.float32) / alpha
    z = offset.to(torch.float32) - beta * s if beta else offset.to(torch.float32)
    return s, z
