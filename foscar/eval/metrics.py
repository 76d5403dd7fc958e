"""The three measurements of ``foscar eval``, each on a prefill shared by every format.

A prompt's prefill does not depend on the KV format (prefill attention runs at the model's
precision over the K/V it just computed), so each prompt is prefilled once into transformers'
``DynamicCache`` and its K/V are written into a fresh :class:`FoscarCache` per format
(:meth:`FoscarCache.load_prompt`); only what follows reads the quantized cache:

* **decode-path perplexity**: the prefix minus its last token is prefilled; then the last
  prefix token and the scored tokens are fed one at a time (teacher forcing), so every scored
  token is predicted by a decode step over the quantized cache (``foscar.decode_attention``, or
  on a CPU the cache's ``decode="dequantized"`` path: the same values to fp32 rounding);
* **greedy agreement**: chat prompts are prefilled; the first token comes from the prefill
  (the same for every format), the next ones are decoded greedily through the cache, and each
  position is compared with the BF16 cache's tokens (end-of-sequence suppressed, so every row
  has the full count);
* **needle in a haystack**: the haystack with the needle is prefilled; the question, the
  answer's lead ("The secret passcode is") and the answer itself (" 60494": a space and five
  digits, one token each) follow as one teacher-forced step over the quantized cache (the
  cache's extend path: the stored K/V dequantized, as a continued conversation reads them). The
  trial counts when the argmax at every answer position is the right token, i.e. exactly when
  greedy decoding would emit the number; the answer's NLL is kept as a graded score. One step
  instead of one per answer token: a CPU can afford more depths. Beside it, the **generated**
  score: after the question (one step) a few tokens are decoded greedily through the quantized
  cache, as a server would answer, and the trial counts when the first number in the answer is
  the passcode (`` "60494".`` counts, where the strict score wants exactly `` 60494``).

The model's own row (``model_row_name``: "FP32" for an fp32 model on a CPU, "BF16 DynamicCache"
for the bf16 model the GPU kernels run with) runs the same loops over a ``DynamicCache`` holding
the model's own K/V (``make_cache(model, DYNAMIC_CACHE, ...)``): no KV rounding beyond the
model's dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..integrations.transformers import FoscarCache, cache_kwarg

__all__ = [
    "Prefill",
    "record_prefill",
    "make_cache",
    "DYNAMIC_CACHE",
    "model_row_name",
    "decode_nll",
    "greedy_tokens",
    "needle_scores",
    "needle_answers",
    "first_number",
]


@dataclass
class Prefill:
    """K/V of a left-padded batch after its prefill.

    ``keys[l], values[l]: [B, H_kv, T, D]`` (model dtype), ``mask: [B, T]`` (1 real, 0 pad),
    ``last_logits: [B, vocab]`` fp32 (the prediction after each row's last token).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    last_logits: torch.Tensor

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @property
    def positions(self) -> torch.Tensor:
        """``[B]``: the position the next token of each row takes."""
        return self.mask.sum(dim=1)


@torch.no_grad()
def record_prefill(model, rows: list[list[int]]) -> Prefill:
    """Prefill each row alone (no pad ever enters SDPA's memory) and left-pad the K/V."""
    from transformers import DynamicCache

    kw = cache_kwarg(model)
    device = model.device
    t = max(len(r) for r in rows)
    keys, values, logits = None, None, []
    mask = torch.zeros(len(rows), t, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        cache = DynamicCache()
        ids = torch.tensor([row], device=device)
        out = model(input_ids=ids, logits_to_keep=1, use_cache=True, **{kw: cache})
        logits.append(out.logits[0, -1].float())
        layer_kv = [(layer.keys, layer.values) for layer in cache.layers]
        if keys is None:
            shape = lambda x: (len(rows), x.shape[1], t, x.shape[3])  # noqa: E731
            keys = [k.new_zeros(shape(k)) for k, _ in layer_kv]
            values = [v.new_zeros(shape(v)) for _, v in layer_kv]
        for layer, (k, v) in enumerate(layer_kv):
            keys[layer][b, :, t - len(row) :] = k[0]
            values[layer][b, :, t - len(row) :] = v[0]
        mask[b, t - len(row) :] = 1
    return Prefill(keys, values, mask, torch.stack(logits))


DYNAMIC_CACHE = "DynamicCache"


def model_row_name(dtype: torch.dtype) -> str:
    """The name of the row that keeps the model's own K/V (a DynamicCache in ``dtype``)."""
    names = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16"}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {list(names)}, got {dtype}")
    # "BF16" alone is the foscar BF16 cache's row
    return names[dtype] if dtype == torch.float32 else f"{names[dtype]} DynamicCache"


def make_cache(model, fmt, prefill: Prefill, extra_tokens: int):
    """A cache holding ``prefill``: a loaded FoscarCache of the format ``fmt``, or
    (``fmt=DYNAMIC_CACHE``) a DynamicCache of the model's own K/V."""
    if fmt == DYNAMIC_CACHE:
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(prefill.keys, prefill.values)):
            cache.update(k.clone(), v.clone(), layer)
        return cache
    cache = FoscarCache(
        fmt,
        model.config,
        max_cache_len=prefill.length + extra_tokens,
        max_batch_size=prefill.mask.shape[0],
    )
    cache.load_prompt(prefill.keys, prefill.values, prefill.mask)
    return cache


class _Stepper:
    """Feeds tokens to the model over one cache, keeping the 2D mask and positions."""

    def __init__(self, model, cache, prefill: Prefill) -> None:
        self.model, self.cache = model, cache
        self.kw = cache_kwarg(model)
        self.mask = prefill.mask
        self.positions = prefill.positions

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        """``tokens: [B, n]`` -> logits of the last one ``[B, vocab]`` fp32, or with ``keep``
        the logits of the last ``keep`` ones ``[B, keep, vocab]``."""
        b, n = tokens.shape
        self.mask = torch.cat([self.mask, self.mask.new_ones(b, n)], dim=1)
        pos = self.positions.unsqueeze(1) + torch.arange(n, device=tokens.device)
        out = self.model(
            input_ids=tokens,
            attention_mask=self.mask,
            position_ids=pos,
            logits_to_keep=keep or 1,
            **{self.kw: self.cache},
        )
        self.positions = self.positions + n
        return out.logits[:, -1].float() if keep is None else out.logits[:, -keep:].float()


def decode_nll(model, cache, prefill: Prefill, inputs: torch.Tensor, targets: torch.Tensor):
    """Teacher forcing through the decode path: ``inputs, targets: [B, M]`` -> nll ``[B, M]``."""
    step = _Stepper(model, cache, prefill)
    nll = []
    for i in range(inputs.shape[1]):
        logits = step(inputs[:, i : i + 1])
        nll.append(torch.nn.functional.cross_entropy(logits, targets[:, i], reduction="none"))
    return torch.stack(nll, dim=1)


def _greedy(step: _Stepper, first_logits: torch.Tensor, count: int, suppress=()):
    """``count`` greedy tokens ``[B, count]``: the first from ``first_logits: [B, vocab]``, each
    next one from a decode step over the one before; ``suppress`` ids banned."""

    def pick(logits):
        if suppress:
            logits = logits.clone()
            logits[:, list(suppress)] = float("-inf")
        return logits.argmax(dim=-1, keepdim=True)

    tokens = [pick(first_logits)]
    for _ in range(count - 1):
        tokens.append(pick(step(tokens[-1])))
    return torch.cat(tokens, dim=1)


def greedy_tokens(model, cache, prefill: Prefill, count: int, suppress: list[int]):
    """``count`` greedy tokens per row (the first from the prefill), ``suppress`` ids banned."""
    return _greedy(_Stepper(model, cache, prefill), prefill.last_logits, count, suppress)


def needle_scores(model, cache, prefill: Prefill, question: list[int], answers: torch.Tensor):
    """Teacher-force ``question`` and each row's answer in one step over ``cache``.

    ``answers: [B, n]`` token ids (the same count per row). Returns ``(hit [B] bool, nll [B],
    argmax [B, n])``: ``hit`` when the argmax at every answer position is the answer's token
    (greedy decoding after ``question`` would emit the answer), ``nll`` the answer's summed
    negative log-likelihood, ``argmax`` the predicted token at each answer position.
    """
    step = _Stepper(model, cache, prefill)
    b, n = answers.shape
    q = torch.tensor([question], device=answers.device).expand(b, -1)
    logits = step(torch.cat([q, answers[:, :-1]], dim=1), keep=n)  # [B, n, vocab]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), answers, reduction="none")
    argmax = logits.argmax(dim=-1)
    return (argmax == answers).all(dim=1), nll.sum(dim=1), argmax


def needle_answers(model, cache, prefill: Prefill, question: list[int], count: int):
    """Greedy decoding after ``question`` over ``cache``: ``[B, count]`` token ids.

    The question goes in as one step (the extend path, as in :func:`needle_scores`); each
    answer token is a decode step over the quantized cache, as a server would emit it. No
    token is banned: an answer may end early (end of turn) or say the number in any form.
    """
    step = _Stepper(model, cache, prefill)
    q = torch.tensor([question], device=prefill.mask.device).expand(prefill.mask.shape[0], -1)
    return _greedy(step, step(q), count)


def first_number(text: str) -> str | None:
    """The first run of digits in ``text`` (``'"60494".'`` -> ``"60494"``), or None."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None
