"""The demo's workload: deterministic multi-turn chats, streamed through the router."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from stack.demo.config import MODEL, DemoConfig, RequestRecord

# A small fixed vocabulary: prompts are deterministic in the seed and readable in logs.
_VOCAB = (
    "cache block prefix token window router engine layer attention sliding mamba state "
    "offload tier event stream replay index redis score policy latency queue prefill decode "
    "batch hash chunk evict reuse hybrid group memory transfer request turn answer context"
)
_WORDS = tuple(_VOCAB.split())


def _text(rng: random.Random, tokens: int, head: str) -> str:
    words = [head]
    n = len(head)
    while n < tokens:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:tokens]


@dataclass(frozen=True)
class Workload:
    """Deterministic prompts: shared system prompts, one opening user line per turn."""

    system: tuple[str, ...]
    users: tuple[tuple[str, ...], ...]  # [conversation][turn]

    @classmethod
    def build(cls, cfg: DemoConfig) -> Workload:
        rng = random.Random(cfg.seed)
        system = tuple(
            _text(rng, cfg.system_tokens, f"You are assistant {i} of the kvroute demo.")
            for i in range(cfg.system_prompts)
        )
        users = tuple(
            tuple(
                _text(rng, cfg.user_tokens, f"[conversation {c}, turn {t}]")
                for t in range(cfg.turns)
            )
            for c in range(cfg.conversations)
        )
        return cls(system, users)

    def system_for(self, conversation: int) -> str:
        return self.system[conversation % len(self.system)]


def _engine_url(fingerprint: str | None) -> str | None:
    """The simulated engine names itself ``kvroute-engine:host:port`` in every chunk."""
    prefix = "kvroute-engine:"
    if fingerprint and fingerprint.startswith(prefix):
        return f"http://{fingerprint[len(prefix) :]}"
    return None


async def _chat(
    client: httpx.AsyncClient, url: str, messages: list[dict], cfg: DemoConfig, rec: RequestRecord
) -> str:
    """Stream one chat completion; fill ``rec``; return the assistant's text."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": cfg.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    t0 = time.perf_counter()
    fingerprint = None
    try:
        async with client.stream("POST", url, json=body, timeout=cfg.request_timeout_s) as resp:
            rec.status = resp.status_code
            rec.instance = resp.headers.get("x-kvroute-instance")
            predicted = resp.headers.get("x-kvroute-predicted-hit")
            if predicted is not None and predicted.strip().lstrip("-").isdigit():
                rec.predicted_hit_tokens = int(predicted)
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:300]
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:300]
                    break
                fingerprint = chunk.get("system_fingerprint") or fingerprint
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        parts.append(content)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = int(details.get("cached_tokens") or 0)
                    # vLLM reports only cached_tokens (GPU on an engine without offload);
                    # the simulated engine also splits it per tier.
                    hit = usage.get("kv_hit") or {"gpu_tokens": rec.cached_tokens}
                    rec.gpu_hit_tokens = int(hit.get("gpu_tokens") or 0)
                    rec.cpu_hit_tokens = int(hit.get("cpu_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.latency_s = time.perf_counter() - t0
    rec.instance = rec.instance or _engine_url(fingerprint)
    if rec.ok and rec.prompt_tokens == 0:
        rec.error = "stream ended without a usage chunk"
    return "".join(parts)


async def run_workload(
    router_url: str,
    cfg: DemoConfig,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """All conversations at once (staggered starts), each turn after the previous reply."""
    work = Workload.build(cfg)
    url = f"{router_url}/v1/chat/completions"
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=cfg.conversations + 4)

    async def conversation(client: httpx.AsyncClient, c: int) -> None:
        await asyncio.sleep(c * cfg.stagger_s)
        messages: list[dict] = [{"role": "system", "content": work.system_for(c)}]
        for t, user in enumerate(work.users[c]):
            messages.append({"role": "user", "content": user})
            rec = RequestRecord(conversation=c, turn=t)
            reply = await _chat(client, url, messages, cfg, rec)
            records.append(rec)
            if on_done is not None:
                on_done(rec)
            if not rec.ok:
                return  # the conversation's history is broken; later turns would mislead
            messages.append({"role": "assistant", "content": reply})
            await asyncio.sleep(cfg.think_s)

    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        await asyncio.gather(*(conversation(client, c) for c in range(cfg.conversations)))
    return records
