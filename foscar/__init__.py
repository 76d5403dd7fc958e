"""foscar: decode attention over 2- and 4-bit paged KV caches through affine folding.

Public API (shapes in each docstring):

- formats: :class:`QuantFormat`, :class:`KVFormat`, :class:`GroupAxis`, :class:`OperandMapping`
- cache: :class:`QuantizedKVCache`, :class:`DecodeBatch`, :func:`effective_bits`,
  :func:`layer_formats`
- decode: :func:`decode_attention`, :class:`DecodePlan` (planned once, run per call)
- references: :mod:`foscar.reference`
"""

from .cache import DecodeBatch, QuantizedKVCache, effective_bits, layer_formats
from .decode import DecodePlan, decode_attention
from .formats import GroupAxis, KVFormat, OperandMapping, QuantFormat

__all__ = [
    "DecodeBatch",
    "DecodePlan",
    "GroupAxis",
    "KVFormat",
    "OperandMapping",
    "QuantFormat",
    "QuantizedKVCache",
    "decode_attention",
    "effective_bits",
    "layer_formats",
]

__version__ = "0.1.0"
