"""The request streams the real-vLLM suite sends: deterministic, byte-tokenized, mixed.

Every prompt is ASCII, so with the tiny models' byte tokenizer (and the simulated engine's)
``len(text)`` is the token count. A stream mixes what prefix caching must get right:
repeats, branches at and inside an earlier prompt, long suffixes, multi-turn chats whose
history holds generated text, and cold long prompts that evict. Generation is forced to one
token (vLLM's ``allowed_token_ids`` / OpenAI's ``logit_bias`` 100, which the simulated
engine mirrors), so both engines hash the same generated tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

FORCED_TOKEN = ord("a")
# logit_bias 100 alone loses to the random Qwen3-Next model's logits; vLLM's
# allowed_token_ids masks every other token.
SAMPLING: dict[str, Any] = {
    "logit_bias": {str(FORCED_TOKEN): 100},
    "allowed_token_ids": [FORCED_TOKEN],
}
ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.;:"


@dataclass
class Step:
    """One request: ``prompt`` (completion) or ``messages`` (chat)."""

    kind: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int = 4
    chat_key: int | None = None  # which conversation this turn continues
    extra: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None
    model: str | None = None  # a served name (a LoRA adapter's); None: the server's model

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **SAMPLING,
        }
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        if self.model is not None:
            body["model"] = self.model
        return body


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def mixed_stream(seed: int, n: int, *, doc_len: tuple[int, int] = (300, 900)) -> list[Step]:
    """``n`` sequential requests of every kind, in an order that also makes eviction happen
    (cold long prompts land between a document and its reuse)."""
    rng = random.Random(seed)
    docs: list[str] = []
    chats: list[list[dict[str, str]]] = []
    steps: list[Step] = []
    kinds = [
        "cold",
        "repeat",
        "branch_end",
        "branch_inside",
        "long_suffix",
        "chat_new",
        "chat_turn",
        "cold_long",
    ]
    weights = [3, 3, 3, 3, 1, 1, 3, 1]
    while len(steps) < n:
        kind = rng.choices(kinds, weights)[0] if docs else "cold"
        if kind in ("cold", "cold_long"):
            lo, hi = doc_len if kind == "cold" else (doc_len[1], 2 * doc_len[1])
            doc = text(rng, rng.randint(lo, hi))
            docs.append(doc)
            steps.append(Step(kind, prompt=doc, max_tokens=rng.choice([1, 4, 40])))
        elif kind == "repeat":
            steps.append(Step(kind, prompt=rng.choice(docs[-4:]), max_tokens=4))
        elif kind == "branch_end":
            doc = rng.choice(docs[-4:])
            steps.append(Step(kind, prompt=doc + text(rng, rng.randint(10, 120))))
        elif kind == "branch_inside":
            doc = rng.choice(docs[-4:])
            cut = rng.randint(len(doc) // 4, max(len(doc) // 4, len(doc) - 20))
            steps.append(Step(kind, prompt=doc[:cut] + text(rng, rng.randint(20, 200))))
        elif kind == "long_suffix":
            doc = rng.choice(docs[-4:])
            steps.append(Step(kind, prompt=doc + text(rng, rng.randint(400, 700))))
        elif kind == "chat_new" or not chats:
            system = rng.choice(docs[-4:])[:300]
            msgs = [
                {"role": "system", "content": system},
                {"role": "user", "content": text(rng, 80)},
            ]
            chats.append(msgs)
            steps.append(
                Step("chat_new", messages=list(msgs), max_tokens=20, chat_key=len(chats) - 1)
            )
        else:
            key = rng.randrange(len(chats))
            steps.append(Step(kind, messages=None, max_tokens=20, chat_key=key))
            steps[-1].extra["user"] = text(rng, rng.randint(20, 100))
    return steps


def next_messages(
    chats: dict[int, list[dict[str, str]]], step: Step, reply: str | None
) -> list[dict[str, str]]:
    """The messages a chat step sends, given the conversation so far; after the request
    the caller appends the reply with :func:`record_reply`."""
    assert step.chat_key is not None
    if step.messages is not None:
        chats[step.chat_key] = list(step.messages)
        return list(step.messages)
    msgs = chats[step.chat_key]
    msgs.append({"role": "user", "content": step.extra["user"]})
    return list(msgs)


def record_reply(chats: dict[int, list[dict[str, str]]], step: Step, reply: str) -> None:
    if step.chat_key is not None:
        chats[step.chat_key].append({"role": "assistant", "content": reply})


def burst(seed: int, size: int, prefix_len: int = 600) -> list[Step]:
    """``size`` requests sharing a new prefix, each with its own suffix (sent at once)."""
    rng = random.Random(seed)
    prefix = text(rng, prefix_len)
    return [
        Step("burst", prompt=prefix + text(rng, rng.randint(30, 250)), max_tokens=4)
        for _ in range(size)
    ]
