"""Per-request sampling in transformers' continuous-batching engine.

Each request carries its own ``temperature``, ``top_p``, ``top_k`` and ``seed`` (the engine's
``add_request(..., **logit_processor_kwargs)``); a row with ``temperature == 0`` is decoded
greedily, untouched. The engine of transformers 5.17 and 5.25 samples with one global RNG (and
one ``do_sample`` for the whole batch), so an answer would depend on which requests shared its
steps and a seed could not make it reproducible. Here the engine stays greedy (``argmax``) and a
logits processor draws the token itself, by the Gumbel-max trick:

    token = argmax_v (logits_v / T + g_v),   g_v = -log(-log(u(key, v))),   v in the kept set

where the kept set is the top-k, then top-p (nucleus) tokens of ``logits / T`` (transformers'
order), and ``u`` is a counter-based hash of ``key = hash(seed, position)`` (position: the
request's tokens so far) and the token id ``v``. So a token depends only on the request's logits,
seed and position: the same seed gives the same answer wherever the logits are the same (they
can move in the last bits with the batch a request shares, or after a preemption re-prefills it,
which flips near-tied tokens), a preempted request draws from the same noise again, and under
tensor parallelism every process (same logits, same request arguments, broadcast by the engine)
picks the same token without sharing an RNG.
The processor returns a one-hot row (0 at the token, -inf elsewhere), which the engine's
``argmax`` picks. It holds no host state between calls and never syncs while a CUDA graph is
being captured, so it can sit inside a captured step.

The engine gives each logits processor one int32 per row (its ``tensors_required`` line of
arguments), so the four arguments ride on four processors: three carry a line each and the
last one, :class:`RequestSampler`, reads them and samples.
"""

from __future__ import annotations

import torch

try:
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
    )
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "foscar.serving.sampling needs transformers>=5.17 with continuous batching: "
        "pip install 'foscar[hf]'"
    ) from e

__all__ = ["RequestSampler", "enable_sampling", "sampling_key", "SAMPLING_KWARGS"]

#: the request arguments the sampler reads, and their types (the engine checks the types)
SAMPLING_KWARGS = {"temperature": float, "top_p": float, "top_k": int, "seed": int}

_MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63 in int64
_HASH_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)
_KEY_MULTIPLIER = 0x27D4EB2F


def _hash32(x: int) -> int:
    """The host side of :func:`_hash32_tensor` on one Python int (same bits)."""
    x &= _MASK32
    for m in _HASH_MULTIPLIERS:
        x ^= x >> 16
        x = (x * m) & _MASK32
    return x ^ (x >> 16)


def _hash32_tensor(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of every element of ``x`` (int64 holding values in [0, 2**32))."""
    for m in _HASH_MULTIPLIERS:
        x = x ^ (x >> 16)
        x = (x * m) & _MASK32
    return x ^ (x >> 16)


def sampling_key(seed: int, position: int) -> int:
    """The int32 key of the token a request of ``seed`` draws at ``position`` (its prompt and
    answer tokens so far): any int seed, folded to 32 bits."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    key = _hash32(_hash32((s ^ (s >> 32)) & _MASK32) ^ (position & _MASK32))
    return key - (1 << 32) if key >= 1 << 31 else key


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise of each ``(key, token)``: ``keys: [B]`` int32, ``token_ids: [B, V]``
    -> ``[B, V]`` float32, a pure function of its inputs (same bits on every device)."""
    key = keys.to(torch.int64) & _MASK32
    x = (token_ids.to(torch.int64) + key.unsqueeze(-1) * _KEY_MULTIPLIER) & _MASK32
    x = _hash32_tensor(x)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(u))


class _ArgumentLine(ContinuousBatchingLogitsProcessor):
    """Carries one request argument per row to :class:`RequestSampler` (module docstring)."""

    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, sampler: RequestSampler, name: str, default) -> None:
        self.sampler = sampler
        self.name = name
        self.default = default
        self.supported_kwargs = {name: SAMPLING_KWARGS[name]}
        self.dtype = torch.float32 if SAMPLING_KWARGS[name] is float else torch.int32

    def _int32(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=self.dtype, device="cpu").view(torch.int32)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(self._int32([self.default] * int32_tensor.numel()).view_as(int32_tensor))

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        values = [r.state.logit_processor_kwargs.get(self.name, self.default)
                  for r in requests_with_new_token]
        if self.dtype is torch.int32:  # (top_k: beyond int32 keeps every token anyway)
            values = [min(max(int(x), 0), 2**31 - 1) for x in values]
        return self._int32(values)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        self.sampler.lines[self.name] = tensor_arg
        return scores


class RequestSampler(ContinuousBatchingLogitsProcessor):
    """Draws each sampled row's token (module docstring); greedy rows pass unchanged.

    Its line of arguments is the row's key (:func:`sampling_key` of the request's ``seed`` and
    position); the temperature, top-k and top-p lines come from the :class:`_ArgumentLine`
    processors placed before it (:meth:`processors`).
    """

    supported_kwargs: dict[str, type] = {"seed": int}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.lines: dict[str, torch.Tensor] = {}

    def processors(self) -> list[ContinuousBatchingLogitsProcessor]:
        """The four processors to append to the engine's list, in order."""
        return [
            _ArgumentLine(self, "temperature", 0.0),
            _ArgumentLine(self, "top_k", 0),
            _ArgumentLine(self, "top_p", 1.0),
            self,
        ]

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        keys = []
        for r in requests_with_new_token:
            state = r.state
            seed = state.logit_processor_kwargs.get("seed", 0)
            # prompt + answer so far: unchanged when a preempted request folds its answer into
            # its prompt, so it draws the same tokens again
            position = len(state.initial_tokens) + len(state.generated_tokens)
            keys.append(sampling_key(seed, position))
        return torch.tensor(keys, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        """``scores: [B, V]`` float32 -> ``[B, V]``: a sampled row one-hot (0 at its token,
        -inf elsewhere), a greedy row as it came."""
        rows, vocab = scores.shape
        temperature = self.lines["temperature"][:rows].view(torch.float32)
        sampled = temperature > 0
        capturing = scores.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not bool(sampled.any()):  # greedy batch: skip the sort
            return scores
        top_k = self.lines["top_k"][:rows].to(torch.int64)
        top_p = self.lines["top_p"][:rows].view(torch.float32)
        logits = scores / torch.where(sampled, temperature, 1.0).unsqueeze(-1)
        ordered, order = logits.sort(dim=-1, descending=True)  # [B, V]
        ranks = torch.arange(vocab, device=scores.device)
        keep = ranks < torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
        ordered = ordered.masked_fill(~keep, float("-inf"))
        probs = ordered.softmax(dim=-1)
        # a token stays while the tokens before it hold less than top_p (the first always does)
        keep &= (probs.cumsum(dim=-1) - probs) < top_p.unsqueeze(-1)
        ordered = ordered.masked_fill(~keep, float("-inf"))
        choice = (ordered + gumbel_noise(tensor_arg[:rows], order)).argmax(dim=-1, keepdim=True)
        token = order.gather(-1, choice)
        one_hot = torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)
        return torch.where(sampled.unsqueeze(-1), one_hot, scores)


def enable_sampling(manager) -> None:
    """Give ``manager`` (a transformers ``ContinuousBatchingManager``, not started) per-request
    sampling: its ``add_request`` then takes ``temperature`` (0: greedy, the default), ``top_p``
    (1: all), ``top_k`` (0: all) and ``seed`` (int). Calling it again changes nothing.

    The manager's generation config must decode greedily (``do_sample=False``, as
    :func:`foscar.serving.build_manager` sets): the engine's ``argmax`` picks the drawn token.
    The engine's logprobs (``return_logprobs``) then read the one-hot rows: 0 for a sampled
    token, meaningless (the server refuses ``logprobs``).
    Raises ``ValueError`` for a running manager or one without the engine's logits processors.
    """
    processors = getattr(manager, "logit_processor", None)
    needed = ("logits_processor", "tensors_required", "supported_keys", "do_processing")
    if processors is None or not all(hasattr(processors, name) for name in needed):
        raise ValueError(
            "enable_sampling needs a transformers ContinuousBatchingManager (5.17 or later): "
            f"{type(manager).__name__} has no continuous-batching logits processors"
        )
    if any(isinstance(p, RequestSampler) for p in processors.logits_processor):
        return
    is_running = getattr(manager, "is_running", None)
    if is_running is not None and is_running():
        raise ValueError("enable_sampling: the manager is running; call it before start()")
    if getattr(manager.generation_config, "do_sample", False):
        raise ValueError(
            "enable_sampling: the manager's generation config samples (do_sample=True); build "
            "it greedy, the sampler draws each request's tokens itself"
        )
    added = RequestSampler().processors()
    processors.logits_processor.extend(added)
    processors.tensors_required += len(added)
    for p in added:
        processors.supported_keys.update(p.supported_kwargs)
    processors.do_processing = True
