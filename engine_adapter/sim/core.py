"""``EngineCore``: a continuous-batching scheduler over the hybrid KV cache, on a clock.

Each engine step: drop aborted requests, extend running requests (prefill chunks, then one
decode token each), admit waiting requests while the token budget, the batch size and the
free blocks allow (each admission looks up the GPU hit and the CPU extension with the same
rule a router uses), preempt the newest running request when a running one cannot grow,
"compute" for as long as the timing model says, sample filler tokens, and publish the
step's events as one ``KVEventBatch`` -- the order vLLM's scheduler follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine_adapter.coordinator import KVCacheManager
from engine_adapter.request import Request
from engine_adapter.sim.metrics import EngineMetrics
from engine_adapter.sim.timing import TimingModel
from events.publisher import EventPublisher, NullEventPublisher

__all__ = ["EngineCore", "RequestOutput", "SchedulerConfig"]

logger = logging.getLogger(__name__)

FILLER_TEXT = (
    " The quick brown fox jumps over the lazy dog while the KV cache remembers every block."
)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request (``new_token_ids`` may be empty)."""

    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096


@dataclass(eq=False)
class _Seq:
    request: Request
    max_tokens: int
    out: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    generated: int = 0
    gpu_hit: int = -1  # -1: not admitted yet; reported hits are the first admission's
    cpu_hit: int = 0
    arrival: float = field(default_factory=time.monotonic)
    aborted: bool = False

    def output(self, new: list[int], finished: bool) -> RequestOutput:
        return RequestOutput(
            new_token_ids=new,
            finished=finished,
            finish_reason="length" if finished else None,
            prompt_tokens=self.request.num_prompt_tokens,
            completion_tokens=self.generated,
            gpu_hit_tokens=max(self.gpu_hit, 0),
            cpu_hit_tokens=self.cpu_hit,
        )


class EngineCore:
    """Runs the scheduler loop; ``submit`` streams a request's outputs."""

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        timing: TimingModel | None = None,
        scheduler: SchedulerConfig | None = None,
        publisher: EventPublisher | None = None,
        filler_token_ids: list[int] | None = None,
        model_name: str = "kvroute-sim",
    ) -> None:
        self.kv = kv
        self.timing = timing or TimingModel()
        self.config = scheduler or SchedulerConfig()
        self.publisher = publisher or NullEventPublisher()
        self.filler = filler_token_ids or list(FILLER_TEXT.encode())
        self.metrics = EngineMetrics(model_name)
        self.registry = self.metrics.registry
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.healthy = True
        self.steps = 0

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine-core")

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop admitting, let running requests finish (bounded), close the publisher."""
        self._stopping = True
        self.healthy = False
        deadline = time.monotonic() + drain_timeout
        while (self.running or self.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for seq in [*self.running, *self.waiting]:
            seq.out.put_nowait(RuntimeError("engine shut down"))
        self.kv.flush()
        if (batch := self.kv.step_events()) is not None:
            self.publisher.publish(batch)
        self.publisher.shutdown()
        self.kv.close()

    # ---- requests -----------------------------------------------------------------

    async def submit(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes.

        Closing the iterator early (client gone) aborts the request and frees its blocks.
        """
        if self._stopping:
            raise RuntimeError("engine is shutting down")
        seq = _Seq(self.kv.new_request(request_id, prompt_token_ids), max_tokens)
        self.waiting.append(seq)
        self._wake.set()
        done = False
        try:
            while not done:
                item = await seq.out.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:
                seq.aborted = True
                self._wake.set()

    # ---- the loop -----------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self._step()
            except Exception:
                logger.exception("engine step failed")
                self.healthy = False
                for seq in [*self.running, *self.waiting]:
                    seq.out.put_nowait(RuntimeError("engine step failed"))
                    self._release(seq)
                self.running.clear()
                self.waiting.clear()
                self.healthy = True

    async def _step(self) -> None:
        self._drop_aborted()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        prefill_tokens = decode_seqs = loaded_tokens = 0

        # 1. Running requests first (oldest first); preempt the newest to make room.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            req = seq.request
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                scheduled = [(s, k) for s, k in scheduled if s is not victim]
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                if req.num_computed_tokens > req.num_prompt_tokens:
                    decode_seqs += 1
                else:
                    prefill_tokens += n
                i += 1

        # 2. Admit waiting requests while budget, batch size and blocks allow.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            req = seq.request
            gpu, cpu = self.kv.lookup(req)
            start = min(gpu + cpu, req.num_tokens - 1)
            n = min(req.num_tokens - start, budget)
            try:
                ok = self.kv.allocate_slots(req, n, gpu, cpu)
            except LookupError:  # a CPU chunk went away between lookup and load
                ok = self.kv.allocate_slots(req, n, gpu, 0)
                cpu = 0
            if not ok:
                if not self.running and not scheduled:
                    # Nothing else holds blocks: this request can never fit.
                    self.waiting.popleft()
                    seq.out.put_nowait(
                        RuntimeError(
                            f"request needs more KV blocks than the engine has ({n} tokens)"
                        )
                    )
                    continue
                break
            self.waiting.popleft()
            if seq.gpu_hit < 0:
                seq.gpu_hit, seq.cpu_hit = gpu, cpu
                self.metrics.on_admitted(req.num_prompt_tokens, gpu, cpu)
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            prefill_tokens += n
            loaded_tokens += cpu

        if not scheduled:
            if self.running or self.waiting:
                await asyncio.sleep(self.timing.step_seconds(0, 0, 0))
            self._publish()
            return

        # 3. "Compute", then sample a token for every request whose tokens are all computed.
        await asyncio.sleep(self.timing.step_seconds(prefill_tokens, decode_seqs, loaded_tokens))
        self.steps += 1
        now = time.monotonic()
        for seq, _ in scheduled:
            req = seq.request
            if seq.aborted or req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk with more to come
            if seq.generated >= seq.max_tokens:
                self._finish(seq, [])
                continue
            tok = self.filler[(seq.generated + len(req.prompt_token_ids)) % len(self.filler)]
            if seq.generated == 0:
                self.metrics.ttft.observe(now - seq.arrival)
            seq.generated += 1
            req.append_output_token_ids(tok)
            if seq.generated >= seq.max_tokens:
                self._finish(seq, [tok])
            else:
                seq.out.put_nowait(seq.output([tok], finished=False))
        self.metrics.generation_tokens.inc(sum(1 for s, _ in scheduled if s.generated))
        self._publish()

    def _publish(self) -> None:
        batch = self.kv.step_events()
        if batch is not None:
            self.publisher.publish(batch)

    def _finish(self, seq: _Seq, new: list[int]) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request)
        self.metrics.request_success.inc()
        seq.out.put_nowait(seq.output(new, finished=True))

    def _preempt(self, seq: _Seq) -> None:
        """vLLM's recompute preemption: free the blocks, re-queue at the front."""
        self.kv.free(seq.request)
        seq.request.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.metrics.preemptions.inc()

    def _release(self, seq: _Seq) -> None:
        with contextlib.suppress(Exception):
            self.kv.free(seq.request)

    def _drop_aborted(self) -> None:
        for seq in [s for s in self.running if s.aborted]:
            self.running.remove(seq)
            self.kv.free(seq.request)
        if any(s.aborted for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.aborted)

    # ---- metrics --------------------------------------------------------------------

    def refresh_metrics(self) -> None:
        offload = self.kv.offload
        cpu_usage = (
            offload.num_used_chunks / offload.config.num_cpu_chunks
            if offload is not None and offload.config.num_cpu_chunks
            else 0.0
        )
        self.metrics.refresh(len(self.running), len(self.waiting), self.kv.usage, cpu_usage)
