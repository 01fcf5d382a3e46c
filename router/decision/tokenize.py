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
        # The last token-id prompt checked and its packing, until prompt_ids_packed takes
        # it (no await between the check and the taking: never another request's).
        self._checked: tuple[list[Any], bytes] | None = None

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
        ids = await self._prompt_ids(body, kind, instance)
        checked, self._checked = self._checked, None
        return ids, checked[1] if checked is not None and checked[0] is ids else None

    async def _prompt_ids(
        self, body: dict[str, Any], kind: str, instance: str | None
    ) -> list[int] | None:
        self._checked = None
        extra = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            if self.remote:
                extra |= {k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}
                return await self._remote({"messages": messages, **extra}, instance)
            assert self._local is not None
            try:
                return self._local.encode_chat(messages, body)
            except (AttributeError, TypeError, ValueError):
                return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            packed = packed_u32(prompt) if native_hashing() else None
            if packed is not None:  # all exact ints in [0, 2**32): token ids
                self._checked = (prompt, packed)
                return prompt
            if _token_ids(prompt):
                return prompt
        if not isinstance(prompt, str):
            return None
        specials = body.get("add_special_tokens", True) is not False
        if self.remote:
            if not specials:
                extra["add_special_tokens"] = False
            return await self._remote({"prompt": prompt, **extra}, instance)
        assert self._local is not None
        return self._local.encode_prompt(prompt) if specials else self._local.encode(prompt)

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


def _token_ids(prompt: list[Any]) -> bool:
    """Whether every item is a non-negative int (bools are not token ids). The caller
    tries the native packer first, which checks exact ints below 2**32 in one C pass (a
    Python loop over a 240k-token prompt cost ~7 ms of every decision); only what it
    refuses -- an id past 2**32, or a bad item -- gets this check, which decides."""
    return all(type(t) is int and t >= 0 for t in prompt)
