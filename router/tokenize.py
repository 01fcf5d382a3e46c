"""Token ids for routing: exactly the engine's, or the block hashes never match.

Local tokenizers (byte-level default, or a ``tokenizer.json``) reproduce the simulated
engine's; ``remote`` asks an instance's vLLM-shaped ``/tokenize`` (what real vLLM needs:
its chat templates live with the model). ``None`` means "cannot tell": the request is then
routed on load alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx

from events.tokenizer import Tokenizer, apply_chat_template, load_tokenizer

__all__ = ["RoutingTokenizer"]

log = logging.getLogger(__name__)


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
        extra = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            if self.remote:
                return await self._remote({"messages": messages, **extra}, instance)
            try:
                return self._encode(apply_chat_template(messages))
            except (AttributeError, TypeError):
                return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(type(t) is int and t >= 0 for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            return None
        if self.remote:
            return await self._remote({"prompt": prompt, **extra}, instance)
        return self._encode(prompt)

    def _encode(self, text: str) -> list[int]:
        assert self._local is not None
        return self._local.encode(text)

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
