"""One request's answers: its choices' text, stops, finish reasons, log-probabilities, and the
OpenAI objects (whole or as stream chunks) of a chat or a completion.

A request of ``n`` choices (over ``P`` prompts for a completion) is ``P * n`` engine requests:
one per prompt, prefilled once and forked into its other ``n - 1`` choices
(``num_children``, :mod:`foscar.serving.continuous`). Their outputs arrive, in any order, on one
queue of the request (:class:`Job`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from .text import StopText, TextStream

__all__ = ["Choice", "Job", "TokenText"]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte, to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """Each token's text alone and its bytes (OpenAI's ``token`` and ``bytes``): a byte-level
    BPE token's own bytes (part of a character, where it carries part of one), a SentencePiece
    byte-fallback token's byte, else its text's UTF-8; remembered per token id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self._seen.get(token)
        if found is None:
            text = self.tokenizer.decode([token])
            found = (text, list(self._bytes(token, text)))
            if len(self._seen) < 1 << 20:
                self._seen[token] = found
        return found

    def _bytes(self, token: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if piece and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
                if raw.decode("utf-8", "replace") == text or "\ufffd" in text:
                    return raw
        return text.encode()


class GenerationFailed(RuntimeError):
    """The engine failed a request (its output carries the error)."""


@dataclass
class Choice:
    """One engine request of a job: its answer so far, as text and tokens."""

    index: int
    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    text: TextStream
    stop: StopText
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    shown: int = 0  # characters given out (with stop strings)
    logprobs_sent: int = 0  # tokens whose log-probabilities were given out
    finished: bool = False
    early: bool = False  # ended here (a stop string or token) before the engine ended it
    hit_stop: bool = False
    first_token_s: float | None = None

    def update(self, output, start: float) -> str:
        """Take the engine's output; returns the text it adds that may be shown now."""
        tokens = list(output.generated_tokens)
        finished = output.is_finished()
        if tokens and self.first_token_s is None:
            self.first_token_s = time.perf_counter() - start
        text_tokens = tokens
        if self.stop_token_ids:
            for k in range(len(self.tokens), len(tokens)):
                if tokens[k] in self.stop_token_ids:  # kept in the answer, not in its text
                    tokens, text_tokens = tokens[: k + 1], tokens[:k]
                    self.hit_stop = True
                    self.early = not (finished and k == len(output.generated_tokens) - 1)
                    finished = True
                    break
        self.tokens = tokens
        piece = self.text.push(text_tokens)
        if finished:
            piece += self.text.finish()
        if self.stop.stops:
            shown = self.stop.shown(self.text.text, finished)
            piece = shown[self.shown :]
            self.shown = len(shown)
            if self.stop.end(self.text.text) is not None:
                self.hit_stop = True
                self.early = self.early or not finished
                finished = True
        self.finished = finished
        return piece

    def answer_text(self) -> str:
        text = self.text.text
        end = self.stop.end(text)
        return text if end is None else text[:end]

    def finish_reason(self) -> str:
        if self.hit_stop or self.tokens and self.tokens[-1] in self.eos_token_ids:
            return "stop"
        return "length" if len(self.tokens) >= self.max_new_tokens else "stop"


class Job:
    """A request's choices, its id, kind (``chat`` or ``completion``) and model name, and the
    OpenAI objects of its answers."""

    def __init__(self, kind: str, request_id: str, model_id: str, tokenizer,
                 logprobs: int | None) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)
        self.logprobs = logprobs  # alternatives per token; None: no log-probabilities
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.choices: dict[str, Choice] = {}
        self.prompt_tokens = 0

    def add(self, choice: Choice, *, new_prompt: bool) -> None:
        self.choices[choice.request_id] = choice
        if new_prompt:
            self.prompt_tokens += choice.prompt_tokens

    def usage(self) -> dict:
        completion = sum(len(c.tokens) for c in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    # ------------------------------------------------------------------ log-probabilities
    def _token_text(self, token: int) -> str:
        return self.token_text(token)[0]

    def logprobs_of(self, entries) -> dict | None:
        """OpenAI's ``logprobs`` of a choice for ``entries`` (:class:`TokenLogprob`)."""
        if self.logprobs is None:
            return None
        if self.kind == "chat":
            def item(token, logprob):
                text, raw = self.token_text(token)
                return {"token": text, "logprob": logprob, "bytes": raw}

            return {"content": [{**item(e.token, e.logprob),
                                 "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries], "refusal": None}
        tokens = [self._token_text(e.token) for e in entries]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ whole answers
    def whole(self, entries_of) -> dict:
        """The whole answer; ``entries_of(choice)``: its log-probability entries."""
        choices = []
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            body = {"index": c.index, "logprobs": self.logprobs_of(entries_of(c)),
                    "finish_reason": c.finish_reason()}
            if self.kind == "chat":
                body["message"] = {"role": "assistant", "content": c.answer_text()}
            else:
                body["text"] = c.answer_text()
            choices.append(body)
        return {"id": self.request_id,
                "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model_id, "choices": choices,
                "usage": self.usage()}

    # ------------------------------------------------------------------ stream chunks
    def chunk(self, index: int, piece: str | None, *, role: bool = False, logprobs=None,
              finish_reason: str | None = None) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else (
                {} if piece is None else {"content": piece})
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": piece or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model_id, "choices": [choice]}

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model_id, "choices": [], "usage": self.usage()}
