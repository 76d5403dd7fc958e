"""Pydantic models of the OpenAI request bodies ``foscar serve`` takes.

Every model forbids fields it does not define (a request naming one is refused with HTTP 400
naming it: nothing is silently ignored) and reads JSON strictly (``"9"`` is not an integer,
``true`` not a number). Fields beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``) are vLLM's names for the same things.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..sampling import MAX_TOP_LOGPROBS

__all__ = [
    "ChatMessage",
    "ChatCompletionRequest",
    "CompletionRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "MAX_N",
    "MAX_STOPS",
]

#: most stop strings a request may give (OpenAI's limit)
MAX_STOPS = 4
#: most choices one request may ask for
MAX_N = 16
#: OpenAI's range of temperature
MAX_TEMPERATURE = 2.0

_STRICT = ConfigDict(extra="forbid", strict=True)

Token = Annotated[int, Field(ge=0)]


class TextPart(BaseModel):
    """One part of a message's content: text only."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message of a chat: its role and its text (a string or text parts)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class SamplingFields(BaseModel):
    """The fields a chat and a completion share: length, sampling, penalties, stops, stream."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    # the engine carries it as an int32 per row; -1 (vLLM's) or 0: every token
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Token] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > MAX_STOPS or not all(stops)):
            raise ValueError(f"give a non-empty string or a list of at most {MAX_STOPS} of them")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias):
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys are token ids (digits), got {key!r}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream true")
        return self

    def stops(self) -> list[str]:
        return list(self.stop or [])


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _lengths_and_logprobs(self):
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError("max_tokens: it and max_completion_tokens differ; give one")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only with logprobs true")
        return self

    def answer_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def logprob_alternatives(self) -> int | None:
        """Alternatives per token (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either (each
    prompt gets ``n`` choices, indexed prompt by prompt)."""

    prompt: str | list[Token] | list[str] | list[list[Token]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt):
        if isinstance(prompt, list) and (not prompt or any(
                isinstance(p, (str, list)) and not p for p in prompt)):
            raise ValueError("give a non-empty prompt (text or token ids), or a list of them")
        return prompt

    def answer_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_alternatives(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: ``prompt`` (text), or ``messages`` through the chat template."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages, one of them")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[Token]
