"""Remote tokenization (real vLLM's ``/tokenize``) is spread over the request's pool."""

from __future__ import annotations

import json

import httpx
from routerkit import ScriptedUpstream, StaticRegistry

from router.build import build_router
from router.config import RouterSettings
from router.decision.layout import LayoutRegistry
from router.decision.tokenize import RoutingTokenizer
from router.index.memory import MemoryIndex

PROMPT = "a prompt long enough to hash a few blocks " * 8


class Tokenizing(ScriptedUpstream):
    """A vLLM-shaped ``/tokenize``: byte ids, counting the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def answer(self, head, body, reader, writer) -> bool:
        self.calls += 1
        ids = list(json.loads(body)["prompt"].encode())
        out = json.dumps({"tokens": ids, "count": len(ids)}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
        return True


async def test_remote_tokenization_goes_to_the_least_busy_instance() -> None:
    """Not always the pool's first: one API server would tokenize for the whole fleet."""
    async with Tokenizing() as a, Tokenizing() as b, httpx.AsyncClient() as client:
        registry = StaticRegistry(a.url, b.url)
        settings = RouterSettings(policy="cost", block_size=32, tokenizer="remote")
        tokenizer = RoutingTokenizer("remote", client)
        router = build_router(settings, index=MemoryIndex(), layouts=LayoutRegistry(),
                              registry=registry, tokenizer=tokenizer)  # fmt: skip
        registry.instances[0].running_requests = 3
        d = await router.decide({"prompt": PROMPT}, "completion", record=False)
        assert (a.calls, b.calls) == (0, 1) and d.prompt_tokens == len(PROMPT)
        registry.instances[1].inflight_requests = 5
        await router.decide({"prompt": PROMPT}, "completion", record=False)
        assert (a.calls, b.calls) == (1, 1)
