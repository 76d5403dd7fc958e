"""The FOSCAR decode split kernel for Hopper (sm_90a), written in Triton's Gluon dialect.

Math: attention over a 2- or 4-bit paged KV history whose scales and offsets are folded into
the products (S = c (s'_K (Q . y_K) + z'_K sum Q), P' = bf16(P s'_V), O = V_y^T P' + the offset
term), with the operands y built in registers from the packed bits (design.md).

Data contract: foscar.cache's pools (packed words [pages, Hkv, page_size, head_dim * bits / 32]
int32, (s', z') scale pairs [pages, Hkv, entries, 2] fp32) read through TMA descriptors whose
shared layouts :func:`descriptor_layouts` gives; partial outputs and log2 LSEs per split (or the
output itself for one part) as foscar.kernels.triton_decode's ``decode_split_kernel`` writes them.

Supported: INT2/INT4 K and V, token- or channel-wise (channel-wise: head_dim 128, groups of 2
pages of 64 tokens), head_dim 128 and 64, cache pages of 16-256 tokens for token-wise K and V,
up to 8 query heads per KV head, bf16 (mantissa injection) or E4M3 operands (token-wise K and V
at head_dim 128). Not: the BF16 sink and recent windows (the Triton window program) and the
merge of the splits (the Triton merge kernel). Written against triton 3.6's Gluon API
(foscar.backends.gluon checks the version).

Modules: :mod:`.layouts` (constants, the readers of the ``OPT`` flags, register and shared
layouts), :mod:`.operands` (bits -> bf16 and E4M3 wgmma operands, scales, folds of one page),
:mod:`.tiles` (one consumer's work per tile: one page, two pages, packed heads), :mod:`.kernel`
(the warp-specialized kernel: producer, consumers, their merge).
"""

from .kernel import gluon_decode_split_kernel
from .layouts import MAGIC, descriptor_layouts, words_per_row

__all__ = ["gluon_decode_split_kernel", "descriptor_layouts", "words_per_row", "MAGIC"]
