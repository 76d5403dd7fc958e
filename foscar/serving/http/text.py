"""Text of answers: chat prompts, streamed text that never splits a character, stop strings."""

from __future__ import annotations

__all__ = ["TextStream", "StopText", "prompt_ids"]


def prompt_ids(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True
               ) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, with the assistant's
    turn opened unless ``add_generation_prompt`` is False (``apply_chat_template`` returns a
    list in some transformers versions and a BatchEncoding in others)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


class TextStream:
    """Text of a growing list of tokens, given out in pieces that never split a character (a
    byte-level token can carry half of one): each piece decodes a few tokens before the new ones,
    so the tokenizer's merging of spaces sees its context."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # tokens before this one are given out and need no context again
        self.read = 0  # tokens before this one are given out
        self.text = ""

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        """Take the answer's tokens so far; returns the text they add."""
        self.tokens = list(tokens)
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += piece
        return piece

    def finish(self) -> str:
        """The text not given out yet (the whole answer's decode is the reference)."""
        full = self._decode(self.tokens)
        piece = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += piece
        return piece


class StopText:
    """Where an answer's text ends for a request's stop strings (OpenAI: the answer ends before
    the first of them, which is not returned)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        #: answer tokens that hold any stop string ending in the last one (a token carries at
        #: least one byte of text; a character at most 4)
        self.tail_tokens = 4 * max((len(s) for s in stops), default=0) + 1

    def end(self, text: str) -> int | None:
        """Index of the first stop string in ``text``, None without one."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def shown(self, text: str, final: bool) -> str:
        """The part of ``text`` a stream may give out now: up to a stop string; before it, all
        but a tail that could still grow into one (all of it once the answer is ``final``)."""
        end = self.end(text)
        if end is not None:
            return text[:end]
        if final:
            return text
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]
