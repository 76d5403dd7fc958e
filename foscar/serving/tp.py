"""Tensor parallelism: each process stores and reads only its own KV heads.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under
``torchrun``; the engine's ``DistributedConfig`` / ``tp_plan``), ``k_proj`` and ``v_proj`` are split
by output rows, so process ``r`` of ``n`` computes KV heads ``[r * H / n, (r + 1) * H / n)`` and
the query heads that read them. Its :class:`foscar.serving.PagedKV` holds those heads' pages and
windows only; every process runs the same schedule (the engine broadcasts requests from rank 0),
so the block ids and window slots agree across processes. Every process builds the manager
and starts it; process 0 adds requests and reads results, the others wait for the loop to end
(:meth:`foscar.serving.FoscarBatchingManager.wait`). ``foscar serve`` under ``torchrun`` does
this (:mod:`foscar.commands.serve`): process 0 serves HTTP. OSCAR's rotations are per layer
(shared by the KV heads: every process uses them as they are) or per KV head (each process takes
its heads, :func:`rank_rotations`); the fitted clip ratios are per layer and apply unchanged, and
GPTQ factors are per KV head and are sliced like the rotations.
"""

from __future__ import annotations

from dataclasses import replace

__all__ = ["rank_rotations", "tp_size_of"]


def rank_rotations(rotations, *, rank: int, tp_size: int, num_kv_heads: int):
    """The part of ``rotations`` (:class:`foscar.oscar.OscarRotations` of the whole model, with
    ``num_kv_heads`` KV heads) process ``rank`` of ``tp_size`` applies to its own KV heads."""
    if num_kv_heads % tp_size:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must be divisible by the tensor-parallel size "
            f"({tp_size})"
        )
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")
    if tp_size == 1:
        return rotations
    per_rank = num_kv_heads // tp_size
    heads = slice(rank * per_rank, (rank + 1) * per_rank)
    key, value = rotations.key, rotations.value
    if rotations.per_head:
        key, value = key[:, heads], value[:, heads]
    gptq = rotations.key_gptq
    if gptq is not None:
        gptq = gptq[:, heads]
    return replace(rotations, key=key, value=value, key_gptq=gptq)


def tp_size_of(model) -> int:
    """Processes the model's KV heads are split over (1 without tensor parallelism): the size of
    the ``"tp"`` dimension of the model's device mesh, as the engine reads it."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return 1
    names = mesh.mesh_dim_names
    if names is None:
        return mesh.size()
    return mesh["tp"].size() if "tp" in names else 1
