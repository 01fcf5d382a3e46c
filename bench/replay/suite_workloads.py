"""The routing-quality suite's workloads, as Mooncake-format records plus engine settings.

Every generator is a pure function of its seed (one ``random.Random``), so every router
and every mode replays the same arrival times and tokens. Prompts are whole 512-token
trace blocks where they are shared (contexts, system prompts, documents), so a shared
prefix is shared token for token. Times are trace seconds (``ReplayConfig.time_scale``
divides them).

* ``agent_chat`` (a): 6 agent tasks x 4 tool calls fanned out on a shared ~5k-token
  context, 4 tasks at a time; 8 chat conversations over 3 shared ~3k-token system
  prompts, 5 turns, 4 at a time. 3 ``swa-hybrid`` engines, 700 GPU blocks each.
* ``rag`` (c): long documents (8-16k tokens, a few hot ones) each asked several questions
  whose suffix (1.5-3k tokens) is longer than the sliding window (1024) -- a Gemma-3-like
  layout (5 local : 1 global).
* ``branching`` (d): agents whose trajectories branch (tree search / retries: several
  continuations of one prefix, the best one continued) on a Qwen3-Next-like layout (3
  Mamba : 1 full, 256-token blocks).
* ``recency`` (e): replicas that differ only in how recently they used a prefix: 6 hot
  prefixes, requested round after round in a rotating order, with enough cold traffic in
  between that the older copies are being evicted.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.replay.config import EngineConfig
from bench.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest, reindex

__all__ = [
    "REAL_SHAPE_SCALE",
    "SUITE",
    "SuiteWorkload",
    "agent_chat",
    "agent_chat_real_shape",
    "branching",
    "rag",
    "recency",
]

B = TRACE_BLOCK_TOKENS
_Rec = tuple[float, int, int, tuple[int, ...]]  # time, input length, output, hash ids


def _finish(recs: list[_Rec]) -> list[TraceRequest]:
    recs.sort(key=lambda r: r[0])
    return reindex([TraceRequest(0, round(t * 1000), n, o, h) for t, n, o, h in recs])


def _blocks(ids: itertools.count, tokens: int) -> list[int]:
    return [next(ids) for _ in range(-(-tokens // B))]


def _prompt(stream: list[int], length: int) -> tuple[int, tuple[int, ...]]:
    return length, tuple(stream[: -(-length // B)])


def agent_chat(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = itertools.count()
    recs: list[_Rec] = []
    context = _blocks(ids, 10 * B)  # ~5k tokens shared by every agent task
    # Agent tasks, 4 at a time: each step fans 4 tool calls out on the task's context.
    slots = [0.0] * 4
    for _ in range(6):
        k = min(range(4), key=slots.__getitem__)
        t = slots[k] + rng.uniform(0, 0.5)
        stream = list(context) + _blocks(ids, 2 * B)  # the task
        length = len(context) * B + rng.randint(100, 400)
        for _call in range(4):
            length += rng.randint(80, 300)  # the call's own instructions
            stream += _blocks(ids, B)
            n, h = _prompt(stream, length)
            recs.append((t + rng.uniform(0, 0.1), n, rng.randint(32, 128), h))
            t += rng.uniform(1.0, 2.5)  # the calls of a task follow one another
        slots[k] = t
    # Chat: 8 conversations over 3 system prompts (~3k tokens), 5 turns, 4 at a time.
    systems = [_blocks(ids, 6 * B) for _ in range(3)]
    slots = [rng.uniform(0, 1.0) for _ in range(4)]
    for c in range(8):
        k = min(range(4), key=slots.__getitem__)
        t = slots[k]
        stream = list(systems[c % 3])
        length = len(stream) * B
        for _turn in range(5):
            length += rng.randint(50, 400)
            stream += _blocks(ids, 2 * B)  # spare blocks: the turn and the reply
            out = rng.randint(32, 256)
            n, h = _prompt(stream, length)
            recs.append((t, n, out, h))
            length += out  # the reply joins the conversation
            t += rng.uniform(1.5, 4.0)
        slots[k] = t
    return _finish(recs)


REAL_SHAPE_SCALE = 4  # trace tokens per prompt character in the real-vLLM shape


def agent_chat_real_shape(seed: int) -> list[TraceRequest]:
    """``agent_chat`` 4x down, as the real-vLLM harness sends it (``real_vllm.py``): each
    512-token trace block becomes 128 characters, so prompts fit the tiny models' 2,048
    tokens and shared prefixes stay shared (replay it with ``block_chars`` 128)."""
    return [
        replace(r, input_length=max(r.input_length // REAL_SHAPE_SCALE, 1))
        for r in agent_chat(seed)
    ]


def rag(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = itertools.count()
    docs = [_blocks(ids, rng.randint(16, 32) * B) for _ in range(10)]
    weights = [1.0 / (i + 1) for i in range(len(docs))]  # a few hot documents
    recs: list[_Rec] = []
    t = 0.0
    for _ in range(90):
        t += rng.expovariate(1 / 0.5)
        doc = rng.choices(docs, weights)[0]
        question = rng.randint(1536, 3072)  # longer than the 1024-token window
        stream = list(doc) + _blocks(ids, question)
        n, h = _prompt(stream, len(doc) * B + question)
        recs.append((t, n, rng.randint(32, 128), h))
    return _finish(recs)


def branching(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = itertools.count()
    system = _blocks(ids, 4 * B)
    recs: list[_Rec] = []
    for a in range(10):
        t = a * 1.2 + rng.uniform(0, 0.5)
        stream = list(system) + _blocks(ids, 2 * B)
        length = len(system) * B + rng.randint(300, 900)
        for _depth in range(4):
            branches = rng.randint(2, 4)
            kept: list[int] = []
            for b in range(branches):  # candidate continuations of the same trajectory
                extra = rng.randint(200, 700)
                branch = stream + _blocks(ids, 2 * B)
                n, h = _prompt(branch, length + extra)
                recs.append((t + rng.uniform(0, 0.2), n, rng.randint(32, 96), h))
                if b == 0:
                    kept, kept_len = branch, length + extra
            stream, length = kept, kept_len + rng.randint(100, 400)  # best branch continues
            t += rng.uniform(1.0, 2.0)
    return _finish(recs)


def recency(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = itertools.count()
    hot = [_blocks(ids, 8 * B) for _ in range(6)]
    recs: list[_Rec] = []
    t = 0.0
    for _round in range(12):
        order = list(range(len(hot)))
        rng.shuffle(order)
        for i in order:
            t += rng.uniform(0.15, 0.4)
            q = rng.randint(100, 600)
            n, h = _prompt(hot[i] + _blocks(ids, q), len(hot[i]) * B + q)
            recs.append((t, n, rng.randint(16, 64), h))
            if rng.random() < 0.6:  # cold traffic that pushes older copies out
                cold = rng.randint(2, 6) * B
                n, h = _prompt(_blocks(ids, cold), cold)
                recs.append((t + 0.05, n, rng.randint(16, 64), h))
    return _finish(recs)


@dataclass(frozen=True)
class SuiteWorkload:
    key: str  # the letter and a name
    description: str
    engines: int
    engine: EngineConfig
    time_scale: float
    generate: Callable[[int], list[TraceRequest]] | None = None
    trace: str | None = None  # a Mooncake file (repo-relative), else ``generate``
    requests: int | None = None  # a slice of the trace
    start: int = 0
    max_output_tokens: int = 128
    block_chars: int = TRACE_BLOCK_TOKENS  # ``ReplayConfig.block_chars``


_TRACES = "bench/replay/traces"
# key: (what it is, engines, profile, GPU blocks per engine, time scale, generator or trace)
_ROWS: dict[str, tuple[str, int, str, int, float, Callable[[int], list[TraceRequest]] | str]] = {
    "a_agent_chat": (
        "agent fan-out (6x4 on a 5k context) + 8 chats over 3 system prompts, swa-hybrid",
        3, "swa-hybrid", 700, 20.0, agent_chat,
    ),
    "b_mooncake_conversation": (
        "Mooncake conversation trace (shipped; first 500 requests), gemma3 layout",
        8, "gemma3", 16_384, 4.0, f"{_TRACES}/conversation_slice.jsonl",
    ),
    "b_mooncake_synthetic": (
        "Mooncake synthetic trace (FAST25-release; first 500 requests), gemma3 layout",
        8, "gemma3", 16_384, 4.0, f"{_TRACES}/synthetic_slice.jsonl",
    ),
    "c_rag": (
        "long-document RAG, question suffix > window, gemma3 (swa:1024*5,full)",
        3, "gemma3", 3000, 10.0, rag,
    ),
    "d_branching": (
        "branching agents on qwen3-next (mamba*3,full, 256-token blocks)",
        3, "qwen3-next", 100, 10.0, branching,
    ),
    "e_recency": (
        "replicas differing only in prefix recency (6 hot prefixes + cold traffic)",
        3, "swa-hybrid", 1600, 10.0, recency,
    ),
}  # fmt: skip
SUITE: dict[str, SuiteWorkload] = {
    key: SuiteWorkload(
        key, text, engines, EngineConfig(profile=profile, gpu_blocks=blocks, cpu_blocks=0),
        scale, generate=None if isinstance(src, str) else src,
        trace=src if isinstance(src, str) else None,
    )
    for key, (text, engines, profile, blocks, scale, src) in _ROWS.items()
}  # fmt: skip
# (a) on the real-vLLM harness's engines (``real_vllm.py``), so the sim's figures can be
# set beside vLLM's own: the tiny Gemma-3-like model's groups (5 windows of 64 + full), the
# block size vLLM picks for it on CPU (128), 400 blocks, 512-token chunks, 4 output tokens,
# and the prompt rate those CPU engines reach sharing this machine's 2 cores (~150 tokens/s
# each: it reproduces the harness's TTFTs).
SUITE["a_real_shape"] = SuiteWorkload(
    "a_real_shape",
    "(a) 4x down on the real-vLLM harness's engines (swa:64*5,full, 128-token blocks, 400)",
    3,
    EngineConfig(profile="gemma3", layout="swa:64*5,full", block_size=128, gpu_blocks=400,
                 cpu_blocks=0, max_num_batched_tokens=512, prefill_tokens_per_s=150.0),
    4.0,
    generate=agent_chat_real_shape,
    max_output_tokens=4,
    block_chars=TRACE_BLOCK_TOKENS // REAL_SHAPE_SCALE,
)  # fmt: skip
