"""OpenAI request bodies, validated once at the edge (pydantic), and error bodies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Lenient(BaseModel):
    # Routers (e.g. sglang-router) add their own fields: ignore what we do not know.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    # OpenAI's logit_bias (a bias of 100 makes a token the only choice) and vLLM's
    # allowed_token_ids: the simulated engine honours the cases that force one token (it
    # has no logits), so a test can make it and a real vLLM generate the same tokens.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's per-request prefix-cache isolation: keys the first block's hash.
    cache_salt: str | None = Field(None, min_length=1)

    @property
    def forced_token(self) -> int | None:
        if self.allowed_token_ids and len(set(self.allowed_token_ids)) == 1:
            return self.allowed_token_ids[0]
        if not self.logit_bias:
            return None
        tok, bias = max(self.logit_bias.items(), key=lambda kv: kv[1])
        return int(tok) if bias >= 100 and tok.isdigit() else None


class CompletionRequest(_Sampling):
    model: str | None = None
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=0, le=1_000_000)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def output_len(self) -> int | None:
        return self.max_tokens

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt")
            return v[0]
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        if isinstance(v, list | str) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if isinstance(v, list) and not all(isinstance(p.get("text", ""), str) for p in v):
            raise ValueError("a content part's text must be a string")
        return v


class ChatCompletionRequest(_Sampling):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=0, le=1_000_000)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def output_len(self) -> int | None:
        for v in (self.max_completion_tokens, self.max_tokens):
            if v is not None:
                return v
        return None  # as vLLM: up to the context length


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


def error_body(message: str, status: int, err_type: str = "BadRequestError") -> dict:
    """OpenAI-style error object (vLLM uses the same shape)."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}
