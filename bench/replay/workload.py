"""Generated multi-turn chat and agent workloads, as Mooncake-format records.

Each session owns a stream of 512-token blocks (hash ids) that starts with one of a few
shared system prompts (whole blocks, so sessions share them exactly); a prompt is the
first ``L`` tokens of its session's stream, so block text stays a pure function of the
id (see ``trace.block_text``) while conversations grow:

* chat: every turn appends a user message; the prompt is the whole conversation so far;
  the reply is appended before the next turn, which arrives after a think time.
* agent: each step sends the context, then fans out ``k`` tool calls at once that share
  the context's whole blocks and add their own blocks; the results join the context.

Everything comes from one ``random.Random(seed)``: the same config and seed give the same
records, so every router (and the simulator) replays identical requests.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass

from bench.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest, reindex

__all__ = ["WORKLOAD_KINDS", "WorkloadConfig", "generate"]

WORKLOAD_KINDS = ("chat", "agent", "mixed")
B = TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class WorkloadConfig:
    """Ranges are inclusive ``(low, high)``; times in seconds of trace time."""

    kind: str = "mixed"
    sessions: int = 100
    session_rate_per_s: float = 1.0  # Poisson session starts
    agent_fraction: float = 0.4  # for "mixed"
    system_prompts: int = 4
    system_blocks: tuple[int, int] = (2, 8)
    chat_turns: tuple[int, int] = (2, 8)
    user_tokens: tuple[int, int] = (64, 1500)
    output_tokens: tuple[int, int] = (32, 600)
    think_time_s: float = 15.0  # mean, exponential
    response_time_s: float = 2.0  # assumed reply time before the think time starts
    agent_steps: tuple[int, int] = (2, 6)
    fanout: tuple[int, int] = (2, 4)
    tool_tokens: tuple[int, int] = (128, 2000)
    tool_delay_s: float = 0.2
    max_input_tokens: int = 65_536

    def to_dict(self) -> dict:
        return asdict(self)


class _Session:
    """A session's block stream: ids are allocated as the context grows."""

    def __init__(self, system: list[int], ids: itertools.count) -> None:
        self.stream = list(system)
        self.length = len(system) * B
        self._ids = ids

    def grow(self, tokens: int) -> None:
        self.length += tokens
        while len(self.stream) * B < self.length:
            self.stream.append(next(self._ids))

    def prompt(self) -> tuple[int, tuple[int, ...]]:
        return self.length, tuple(self.stream[: -(-self.length // B)])


def generate(config: WorkloadConfig, seed: int = 0) -> list[TraceRequest]:
    """Records sorted by arrival (ties keep generation order), indexed from 0."""
    if config.kind not in WORKLOAD_KINDS:
        raise ValueError(f"unknown workload kind {config.kind!r}; expected {WORKLOAD_KINDS}")
    rng = random.Random(seed)
    ids = itertools.count()
    systems = [
        [next(ids) for _ in range(rng.randint(*config.system_blocks))]
        for _ in range(config.system_prompts)
    ]
    out: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    seq = itertools.count()

    def emit(t: float, s: _Session, output: int) -> bool:
        length, hash_ids = s.prompt()
        if length > config.max_input_tokens:
            return False
        out.append((t, next(seq), length, output, hash_ids))
        return True

    t = 0.0
    for _ in range(config.sessions):
        t += rng.expovariate(config.session_rate_per_s)
        s = _Session(rng.choice(systems), ids)
        agent = config.kind == "agent" or (
            config.kind == "mixed" and rng.random() < config.agent_fraction
        )
        if agent:
            _agent(config, rng, s, t, emit, ids)
        else:
            _chat(config, rng, s, t, emit)
    out.sort(key=lambda x: (x[0], x[1]))
    return reindex([TraceRequest(0, round(ts * 1000.0), n, o, h) for ts, _, n, o, h in out])


def _chat(config: WorkloadConfig, rng: random.Random, s: _Session, t: float, emit) -> None:
    for _ in range(rng.randint(*config.chat_turns)):
        s.grow(rng.randint(*config.user_tokens))
        output = rng.randint(*config.output_tokens)
        if not emit(t, s, output):
            return
        s.grow(output)
        t += config.response_time_s + rng.expovariate(1.0 / config.think_time_s)


def _agent(
    config: WorkloadConfig,
    rng: random.Random,
    s: _Session,
    t: float,
    emit,
    ids: itertools.count,
) -> None:
    s.grow(rng.randint(*config.user_tokens))  # the task
    for _ in range(rng.randint(*config.agent_steps)):
        output = rng.randint(*config.output_tokens)
        if not emit(t, s, output):
            return
        s.grow(output)
        t += config.response_time_s
        shared = s.length // B  # tool calls share the context's whole blocks
        results = 0
        for _ in range(rng.randint(*config.fanout)):
            branch = _Session(s.stream[:shared], ids)
            extra = rng.randint(*config.tool_tokens)
            branch.grow(extra)
            emit(
                t + rng.uniform(0, config.tool_delay_s), branch, rng.randint(*config.output_tokens)
            )
            results += extra // 4  # the tool's answer, summarised into the context
        s.grow(results)
        t += config.response_time_s + rng.expovariate(1.0 / config.think_time_s)
