"""Token ids for routing: exactly the engine's, or the block hashes never match.

Local tokenizers (byte-level default, or a ``tokenizer.json``) reproduce the simulated
engine's; a model directory reproduces real vLLM's in-process (the model's tokenizer,
BOS rules and chat template); ``remote`` asks an instance's vLLM-shaped ``/tokenize`` (for
when the router cannot read the model files: one round trip per request). ``None`` means
"cannot tell": the request is then routed on load alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx

from events.hashing import native_hashing, packed_u32
from events.tokenizer import Tokenizer, load_tokenizer

__all__ = ["RoutingTokenizer"]

log = logging.getLogger(__name__)

# Request fields that change a chat's prompt ids (vLLM's /tokenize takes them too).
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


class RoutingTokenizer:
    def __init__(
        self,
        spec: str,
        client: httpx.AsyncClient | None = None,
        pick_instance: Callable[[], str | None] | None = None,
    ) -> None:
        self.remote = spec == "remote"
        self._local: Tokenizer | None = None if self.remote else load_tokenizer(spec)
        self._client = client
        self._pick = pick_instance

    async def prompt_ids(
        self, body: dict[str, Any], kind: str, instance: str | None = None
    ) -> list[int] | None:
        """``instance``: where ``remote`` tokenizes (one serving the request's model, whose
        tokenizer it is); default any healthy one."""
        return (await self.prompt_ids_packed(body, kind, instance))[0]

    async def prompt_ids_packed(
        self, body: dict[str, Any], kind: str, instance: str | None = None
    ) -> tuple[list[int] | None, bytes | None]:
        """``prompt_ids``, and for a prompt given as token ids the native uint32 packing
        its check made (``events.hashing.packed_u32``; None otherwise): the prompt's
        hashes start from it instead of packing a 240k-token prompt a second time."""
        if not self.remote:
            return self.local_ids(body, kind)
        extra = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
        text = _text_of(body, kind)
        if isinstance(text, tuple):  # token ids given, or nothing to tokenize
            return text
        if isinstance(text, list):  # a chat's messages
            extra |= {k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}
            return await self._remote({"messages": text, **extra}, instance), None
        if body.get("add_special_tokens", True) is False:
            extra["add_special_tokens"] = False
        return await self._remote({"prompt": text, **extra}, instance), None

    def local_ids(self, body: dict[str, Any], kind: str) -> tuple[list[int] | None, bytes | None]:
        """``prompt_ids_packed`` of a local tokenizer (not ``remote``), without an await:
        the router's decision calls it directly."""
        assert self._local is not None, "a remote tokenizer has no local_ids"
        text = _text_of(body, kind)
        if isinstance(text, tuple):  # token ids given, or nothing to tokenize
            return text
        if isinstance(text, list):  # a chat's messages
            try:
                return self._local.encode_chat(text, body), None
            except (AttributeError, TypeError, ValueError):
                return None, None
        if body.get("add_special_tokens", True) is False:
            return self._local.encode(text), None
        return self._local.encode_prompt(text), None

    async def _remote(self, payload: dict[str, Any], url: str | None) -> list[int] | None:
        url = url or (self._pick() if self._pick else None)
        if url is None or self._client is None:
            return None
        try:
            r = await self._client.post(f"{url}/tokenize", json=payload, timeout=5.0)
            if r.status_code == 200:
                tokens = r.json().get("tokens")
                if isinstance(tokens, list):
                    return tokens
        except (httpx.HTTPError, ValueError):
            log.warning("remote tokenization via %s failed", url, exc_info=True)
        return None


def _text_of(
    body: dict[str, Any], kind: str
) -> str | list[Any] | tuple[list[int] | None, bytes | None]:
    """What a request asks to tokenize: a chat's messages (a list), a completion's prompt
    text (a list holding one string is that string), or -- nothing to tokenize -- the
    answer itself: a prompt's token ids and their packing, or ``(None, None)``."""
    if kind == "chat":
        messages = body.get("messages")
        return messages if isinstance(messages, list) else (None, None)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, str):
        return prompt
    return _token_id_prompt(prompt) if isinstance(prompt, list) else (None, None)


def _token_id_prompt(prompt: list[Any]) -> tuple[list[int] | None, bytes | None]:
    """A prompt given as a list: its token ids and their packing, or ``(None, None)``
    when an item is not a token id."""
    packed = packed_u32(prompt) if native_hashing() else None
    if packed is not None:  # all exact ints in [0, 2**32): token ids
        return prompt, packed
    return (prompt if _token_ids(prompt) else None), None


def _token_ids(prompt: list[Any]) -> bool:
    """Whether every item is a non-negative int (bools are not token ids). The caller
    tries the native packer first, which checks exact ints below 2**32 in one C pass (a
    Python loop over a 240k-token prompt cost ~7 ms of every decision); only what it
    refuses -- an id past 2**32, or a bad item -- gets this check, which decides."""
    return all(type(t) is int and t >= 0 for t in prompt)
