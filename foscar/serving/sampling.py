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

Before the lines, :class:`RequestAdjuster` applies what needs each request's tokens so far, on the
host's view of the batch: ``repetition_penalty`` (transformers' rule over the prompt and answer:
a seen token's logit divided by it when positive, multiplied when negative), ``frequency_penalty``
and ``presence_penalty`` (OpenAI's rule over the answer: ``logit -= frequency * count +
presence * (count > 0)``), ``logit_bias`` (added to the named tokens' logits); and it keeps the
model's own log-probabilities of the rows that ask for ``logprobs``, which the sampler hands,
with the chosen token, to :class:`LogprobSink`. A batch where no request asks for any of these
passes through untouched, without a host sync. They read host state at every step, so they do
not run inside a captured CUDA graph (:func:`host_fields_usable` tells a server whether it may
take them). ``min_p`` (a token stays while its probability is at least ``min_p`` times the
leading one's, after top-k and top-p) rides on a line like ``top_p``.
"""

from __future__ import annotations

import re
import threading
from typing import NamedTuple

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

__all__ = [
    "RequestSampler",
    "RequestAdjuster",
    "LogprobSink",
    "TokenLogprob",
    "enable_sampling",
    "request_sampler",
    "host_fields_usable",
    "apply_penalties",
    "sampling_key",
    "child_request_id",
    "child_request_ids",
    "is_child_request_id",
    "request_seed",
    "SAMPLING_KWARGS",
    "HOST_KWARGS",
    "MAX_TOP_LOGPROBS",
]

#: the request arguments the sampler reads, and their types (the engine checks the types)
SAMPLING_KWARGS = {"temperature": float, "top_p": float, "top_k": int, "seed": int,
                   "min_p": float}
#: the request arguments :class:`RequestAdjuster` reads on the host (module docstring);
#: ``logprobs``: how many alternatives to give beside each chosen token (0 to
#: :data:`MAX_TOP_LOGPROBS`; absent: no log-probabilities); ``logit_bias``: {token id: bias}
HOST_KWARGS = {"repetition_penalty": float, "frequency_penalty": float,
               "presence_penalty": float, "logit_bias": dict, "logprobs": int}
#: most alternatives a request's ``logprobs`` may ask for (OpenAI's ``top_logprobs`` limit)
MAX_TOP_LOGPROBS = 20

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


#: how the engine names child ``i`` (0-based) of a forked request: ``<request_id>__child#<i>``
_CHILD_SUFFIX = re.compile(r"__child#(\d+)$")


def child_request_id(request_id: str, child: int) -> str:
    """The id transformers' engine gives child ``child`` (0-based) of a forked request (its
    ``num_children``: parallel samples of one prompt, prefilled once)."""
    return f"{request_id}__child#{child}"


def child_request_ids(request_id: str, count: int) -> list[str]:
    """The ids of children ``0 .. count - 1`` of a forked request (:func:`child_request_id`)."""
    return [child_request_id(request_id, i) for i in range(count)]


def is_child_request_id(request_id: str) -> bool:
    """Whether ``request_id`` ends as the engine names a forked request's children."""
    return _CHILD_SUFFIX.search(request_id) is not None


def request_seed(seed: int, request_id) -> int:
    """The seed request ``request_id`` draws with: ``seed``, or ``seed + i + 1`` for child ``i``
    of a forked request (which the engine hands its parent's arguments), so that the samples of
    one prompt differ and each stays reproducible: sample ``j`` of a prompt draws with
    ``seed + j``, the parent being sample 0."""
    match = _CHILD_SUFFIX.search(request_id) if isinstance(request_id, str) else None
    return seed if match is None else seed + int(match.group(1)) + 1


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


class TokenLogprob(NamedTuple):
    """One answer token's log-probability under the model (its logits before penalties, bias
    and temperature): ``token``, ``logprob``, and ``top``: the ``logprobs`` likeliest tokens as
    ``(token, logprob)`` pairs, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class LogprobSink:
    """Where the sampler leaves the log-probabilities of watched requests' tokens, one
    :class:`TokenLogprob` per answer token in order (a server watches a request before adding
    it and takes them as its tokens arrive; tokens of an unwatched request are dropped, so a
    request forgotten midway leaves nothing behind)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, list[TokenLogprob]] = {}

    def watch(self, request_id: str) -> None:
        with self._lock:
            self._tokens.setdefault(request_id, [])

    def forget(self, request_id: str) -> list[TokenLogprob]:
        """Stop watching ``request_id``; returns what it holds."""
        with self._lock:
            return self._tokens.pop(request_id, [])

    def take(self, request_id: str, count: int) -> list[TokenLogprob]:
        """The first ``count`` tokens' entries of ``request_id`` (fewer if the engine has not
        handed them yet), kept for the next call."""
        with self._lock:
            return list(self._tokens.get(request_id, ())[:count])

    def put(self, request_id: str, entry: TokenLogprob) -> None:
        with self._lock:
            entries = self._tokens.get(request_id)
            if entries is not None:
                entries.append(entry)

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)


def apply_penalties(scores: torch.Tensor, history: torch.Tensor, answer_counts: torch.Tensor,
                    *, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """Penalized logits: ``scores: [B, V]`` float32; ``history: [B, V]`` bool (the token is in
    the row's prompt or answer); ``answer_counts: [B, V]`` (times the token is in the answer);
    ``repetition, frequency, presence: [B]`` (1, 0, 0: none). Module docstring for the rules."""
    rep = repetition.unsqueeze(-1)
    penalized = torch.where(scores > 0, scores / rep, scores * rep)
    scores = torch.where(history, penalized, scores)
    counts = answer_counts.to(scores.dtype)
    return scores - frequency.unsqueeze(-1) * counts - presence.unsqueeze(-1) * (counts > 0)


class RequestAdjuster(ContinuousBatchingLogitsProcessor):
    """Penalties, ``logit_bias`` and the model's log-probabilities of each row that asks for
    them (module docstring); first of the sampler's processors. Its line of arguments is
    unused (zeros): it reads the rows' requests, recorded by :meth:`prepare_tensor_args` for
    the step that follows (the engine prepares a step's arguments, then runs it)."""

    supported_kwargs: dict[str, type] = dict(HOST_KWARGS)
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, sampler: RequestSampler) -> None:
        self.sampler = sampler
        self.rows: list = []  # the step's request states, in row order, when any asks

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        states = [r.state for r in requests_with_new_token]
        wanted = any(
            any(k in HOST_KWARGS for k in s.logit_processor_kwargs) for s in states
        )
        self.rows = states if wanted else []
        return torch.zeros(len(states), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        self.sampler.raw_logprobs = None
        self.sampler.logprob_rows = []
        if not rows or scores.shape[0] < len(rows):  # (rows past the requests' are padding)
            return scores
        if scores.is_cuda and torch.cuda.is_current_stream_capturing():
            return scores
        kwargs = [s.logit_processor_kwargs for s in rows]
        asked = [i for i, kw in enumerate(kwargs) if kw.get("logprobs") is not None]
        if asked:
            self.sampler.raw_logprobs = scores[asked].log_softmax(dim=-1)
            self.sampler.logprob_rows = [(i, rows[i].request_id, int(kwargs[i]["logprobs"]))
                                         for i in asked]
        penalized = [i for i, kw in enumerate(kwargs)
                     if kw.get("repetition_penalty", 1.0) != 1.0
                     or kw.get("frequency_penalty", 0.0) or kw.get("presence_penalty", 0.0)]
        if penalized:
            scores = scores.clone()
            scores[penalized] = self._penalized(scores[penalized],
                                                [rows[i] for i in penalized])
        biased = [i for i, kw in enumerate(kwargs) if kw.get("logit_bias")]
        if biased:
            scores = scores.clone() if not penalized else scores
            for i in biased:
                bias = kwargs[i]["logit_bias"]
                ids = torch.tensor([int(t) for t in bias], dtype=torch.int64)
                values = torch.tensor([float(v) for v in bias.values()], dtype=scores.dtype)
                scores[i].index_add_(0, ids.to(scores.device), values.to(scores.device))
        return scores

    @staticmethod
    def _penalized(scores: torch.Tensor, states: list) -> torch.Tensor:
        rows, vocab = scores.shape
        device = scores.device
        history = torch.zeros(rows, vocab, dtype=torch.bool)
        counts = torch.zeros(rows, vocab, dtype=torch.int32)
        for j, state in enumerate(states):
            # a preempted request folds its answer into its prompt (the engine's
            # _true_initial_tokens says where the real prompt ended)
            prompt_len = getattr(state, "_true_initial_tokens", 0) or len(state.initial_tokens)
            tokens = list(state.initial_tokens) + list(state.generated_tokens)
            prompt = torch.tensor(tokens[:prompt_len], dtype=torch.int64)
            answer = torch.tensor(tokens[prompt_len:], dtype=torch.int64)
            history[j, prompt] = True
            history[j, answer] = True
            counts[j] = torch.bincount(answer, minlength=vocab)[:vocab].to(torch.int32)
        kw = [s.logit_processor_kwargs for s in states]
        return apply_penalties(
            scores, history.to(device), counts.to(device),
            repetition=torch.tensor([k.get("repetition_penalty", 1.0) for k in kw],
                                    device=device),
            frequency=torch.tensor([k.get("frequency_penalty", 0.0) for k in kw], device=device),
            presence=torch.tensor([k.get("presence_penalty", 0.0) for k in kw], device=device),
        )


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
        self.sink = LogprobSink()
        #: set by :class:`RequestAdjuster` for the step: ``[rows asking, V]`` log-probabilities
        #: and ``(row, request id, alternatives)`` of each such row
        self.raw_logprobs: torch.Tensor | None = None
        self.logprob_rows: list[tuple[int, str, int]] = []

    def processors(self) -> list[ContinuousBatchingLogitsProcessor]:
        """The six processors to append to the engine's list, in order."""
        return [
            RequestAdjuster(self),
            _ArgumentLine(self, "temperature", 0.0),
            _ArgumentLine(self, "top_k", 0),
            _ArgumentLine(self, "top_p", 1.0),
            _ArgumentLine(self, "min_p", 0.0),
            self,
        ]

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        keys = []
        for r in requests_with_new_token:
            state = r.state
            seed = request_seed(state.logit_processor_kwargs.get("seed", 0), state.request_id)
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
            if self.logprob_rows:
                self._hand_logprobs(scores)
            return scores
        top_k = self.lines["top_k"][:rows].to(torch.int64)
        top_p = self.lines["top_p"][:rows].view(torch.float32)
        min_p = self.lines["min_p"][:rows].view(torch.float32)
        logits = scores / torch.where(sampled, temperature, 1.0).unsqueeze(-1)
        ordered, order = logits.sort(dim=-1, descending=True)  # [B, V]
        ranks = torch.arange(vocab, device=scores.device)
        keep = ranks < torch.where(top_k > 0, top_k, vocab).unsqueeze(-1)
        ordered = ordered.masked_fill(~keep, float("-inf"))
        probs = ordered.softmax(dim=-1)
        # a token stays while the tokens before it hold less than top_p (the first always does)
        keep &= (probs.cumsum(dim=-1) - probs) < top_p.unsqueeze(-1)
        ordered = ordered.masked_fill(~keep, float("-inf"))
        probs = ordered.softmax(dim=-1)
        # and while its probability is at least min_p times the leading one's (the first stays)
        keep &= probs >= min_p.unsqueeze(-1) * probs[:, :1]
        ordered = ordered.masked_fill(~keep, float("-inf"))
        choice = (ordered + gumbel_noise(tensor_arg[:rows], order)).argmax(dim=-1, keepdim=True)
        token = order.gather(-1, choice)
        one_hot = torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)
        out = torch.where(sampled.unsqueeze(-1), one_hot, scores)
        if self.logprob_rows:
            self._hand_logprobs(out)
        return out

    def _hand_logprobs(self, out: torch.Tensor) -> None:
        """Each asking row's chosen token (the engine's ``argmax`` of ``out``) with its and its
        alternatives' log-probabilities, to :attr:`sink`."""
        raw, asked = self.raw_logprobs, self.logprob_rows
        self.raw_logprobs, self.logprob_rows = None, []
        if raw is None:
            return
        chosen = out[[i for i, _, _ in asked]].argmax(dim=-1)  # [rows asking]
        chosen_lp = raw.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        width = max(k for _, _, k in asked)
        top_lp, top_ids = raw.topk(width, dim=-1) if width else (None, None)
        chosen, chosen_lp = chosen.tolist(), chosen_lp.tolist()
        top_lp = top_lp.tolist() if width else None
        top_ids = top_ids.tolist() if width else None
        for j, (_, request_id, k) in enumerate(asked):
            top = tuple(zip(top_ids[j][:k], top_lp[j][:k])) if k else ()
            self.sink.put(request_id, TokenLogprob(chosen[j], chosen_lp[j], top))


def enable_sampling(manager) -> None:
    """Give ``manager`` (a transformers ``ContinuousBatchingManager``, not started) per-request
    sampling: its ``add_request`` then takes ``temperature`` (0: greedy, the default), ``top_p``
    (1: all), ``top_k`` (0: all), ``min_p`` (0: all), ``seed`` (int), and the host-side fields
    of :data:`HOST_KWARGS` (module docstring). Calling it again changes nothing.

    The manager's generation config must decode greedily (``do_sample=False``, as
    :func:`foscar.serving.build_manager` sets): the engine's ``argmax`` picks the drawn token.
    The engine's logprobs (``return_logprobs``) then read the one-hot rows: 0 for a sampled
    token, meaningless; a request's ``logprobs`` argument gives the model's own instead
    (:attr:`RequestSampler.sink`, :func:`request_sampler`).
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


def request_sampler(manager) -> RequestSampler | None:
    """The :class:`RequestSampler` :func:`enable_sampling` gave ``manager`` (None without)."""
    processors = getattr(getattr(manager, "logit_processor", None), "logits_processor", ())
    return next((p for p in processors if isinstance(p, RequestSampler)), None)


def host_fields_usable(manager) -> bool:
    """Whether ``manager``'s steps run the host side of :class:`RequestAdjuster` (penalties,
    ``logit_bias``, ``logprobs``): not where they may replay a captured CUDA graph (foscar's
    ``cuda_graphs``, or the engine's own graphs, which it turns on by default on a GPU)."""
    config = getattr(manager, "continuous_batching_config", None)
    graphs = getattr(config, "use_cuda_graph", None)
    if isinstance(graphs, (tuple, list)):  # resolved: (varlen graphs, decode graphs)
        graphs = any(graphs)
    if graphs is None:
        device = getattr(getattr(manager, "model", None), "device", None)
        graphs = getattr(device, "type", "cpu") == "cuda"
    return not graphs
