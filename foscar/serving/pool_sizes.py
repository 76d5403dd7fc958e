"""The sizes of a serving pool: the engine's blocks and foscar's window slots for a memory budget
or a block count (:func:`size_pool`, what :func:`foscar.serving.build_manager` builds), with the
checks of the sizes it is given.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .core import history_bytes_per_token, window_bytes_per_request
from .flashinfer_kv import flashinfer_bytes_per_token
from .kv_spec import ResolvedKV
from .tp import tp_size_of

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_REQUESTS",
    "PoolSizes",
    "size_pool",
    "check_block_size",
    "check_sizes",
    "head_dim_of",
    "num_kv_heads_of",
]

#: tokens per engine block and foscar page
DEFAULT_BLOCK_SIZE = 64
#: window slots when neither ``max_requests`` nor the engine's ``max_requests_per_batch`` is given
DEFAULT_MAX_REQUESTS = 32
#: memory for the cache when neither ``memory_bytes`` nor ``num_blocks`` is given: on a CPU a
#: fixed size, on a GPU this share of the free memory after the model is loaded
DEFAULT_CPU_MEMORY_BYTES = 256 << 20
DEFAULT_GPU_MEMORY_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """The sizes :func:`foscar.serving.build_manager` chose (all per process)."""

    kv: ResolvedKV
    num_blocks: int
    block_size: int
    max_requests: int | None  # window slots (foscar only)
    bytes_per_token: float  # stored bytes per token, all layers (history tokens for foscar)
    window_bytes: int  # one request's BF16 windows, all layers (foscar; 0 for BF16)
    bf16_bytes_per_token: int  # the same token in a BF16 cache
    memory_bytes: int  # pages (+ windows): what the sizes cost
    max_position: int | None


def head_dim_of(config) -> int:
    """A text config's channels per attention head."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim if head_dim is not None else config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    """A text config's KV heads (all of them, before any tensor-parallel split)."""
    heads = getattr(config, "num_key_value_heads", None)
    return heads if heads is not None else config.num_attention_heads


def check_block_size(block_size, resolved: ResolvedKV) -> None:
    """Raise ``ValueError`` unless ``block_size`` is an int >= 4 (a power of two from 16 to 256
    for a foscar cache)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 4:
        raise ValueError(f"block_size must be an int >= 4, got {block_size!r}")
    power_of_two = block_size & (block_size - 1) == 0
    if not resolved.is_bf16 and not (16 <= block_size <= 256 and power_of_two):
        raise ValueError(
            f"block_size must be a power of two from 16 to 256 for a foscar cache, got {block_size}"
        )


def check_sizes(**sizes) -> None:
    """Raise ``ValueError`` unless each of ``sizes`` is None or a positive int, and
    ``memory_bytes`` and ``num_blocks`` are not both given."""
    for name, value in sizes.items():
        bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
        if value is not None and bad:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if sizes["memory_bytes"] is not None and sizes["num_blocks"] is not None:
        raise ValueError("give memory_bytes or num_blocks, not both")


def size_pool(
    model, resolved: ResolvedKV, *, memory_bytes: int | None, num_blocks: int | None,
    block_size: int, max_requests: int | None, request_tokens: int | None,
    requests_per_batch: int | None, window_dtype: torch.dtype,
) -> PoolSizes:
    """The engine's blocks (and foscar's window slots) for ``memory_bytes`` or ``num_blocks``
    (:func:`foscar.serving.build_manager` documents the defaults); raises ``ValueError`` if no
    block fits."""
    text = model.config.get_text_config()
    num_layers = text.num_hidden_layers
    head_dim = head_dim_of(text)
    local_heads = num_kv_heads_of(text) // tp_size_of(model)
    bf16_per_token = 2 * num_layers * local_heads * head_dim * 2
    if memory_bytes is None and num_blocks is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            memory_bytes = int(free * DEFAULT_GPU_MEMORY_SHARE)
        else:
            memory_bytes = DEFAULT_CPU_MEMORY_BYTES

    if resolved.is_bf16 or resolved.flashinfer is not None:
        per_token = (
            2 * num_layers * local_heads * head_dim * model.dtype.itemsize if resolved.is_bf16
            else flashinfer_bytes_per_token(resolved.flashinfer, num_layers, local_heads,
                                            head_dim)
        )
        if num_blocks is None:
            num_blocks = memory_bytes // (per_token * block_size)
        memory = num_blocks * block_size * per_token
        slots, window = None, 0
    else:
        formats = resolved.formats
        per_token = history_bytes_per_token(formats, local_heads, head_dim)
        window = window_bytes_per_request(formats, local_heads, head_dim, window_dtype)
        block = per_token * block_size
        slots = max_requests or requests_per_batch or DEFAULT_MAX_REQUESTS
        if num_blocks is not None and max_requests is None:
            slots = min(slots, num_blocks)
        if num_blocks is None:
            if max_requests is None and request_tokens is not None:
                # as many requests of request_tokens as the memory holds: each takes a window
                # slot and a block for every block_size of its tokens
                per_request = window + math.ceil(request_tokens / block_size) * block
                slots = max(1, memory_bytes // per_request)
            elif max_requests is None:
                slots = max(1, min(slots, memory_bytes // (2 * window)))
            num_blocks = (memory_bytes - slots * window) // block
        memory = num_blocks * block + slots * window
    if num_blocks < 1:
        raise ValueError(
            f"memory_bytes={memory_bytes} holds no block of {block_size} tokens"
            + ("" if not window else f" beside {slots} window slots of {window} bytes")
        )
    return PoolSizes(
        kv=resolved,
        num_blocks=num_blocks,
        block_size=block_size,
        max_requests=slots,
        bytes_per_token=per_token,
        window_bytes=window,
        bf16_bytes_per_token=bf16_per_token,
        memory_bytes=memory,
        max_position=getattr(text, "max_position_embeddings", None),
    )
