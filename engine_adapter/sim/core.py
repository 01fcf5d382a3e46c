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

from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.request import Request
from engine_adapter.sim.metrics import EngineMetrics
from engine_adapter.sim.timing import TimingModel
from events.groups import MambaSpec
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
    """vLLM's scheduler knobs (its CPU defaults: 128 sequences, 2048 tokens a step)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1 << 30


@dataclass(eq=False)
class _Seq:
    request: Request
    max_tokens: int
    forced_token: int | None = None  # logit_bias 100: the only token it may sample
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
        data_parallel_rank: int = 0,
    ) -> None:
        self.kv = kv
        self.timing = timing or TimingModel()
        self.config = scheduler or SchedulerConfig()
        self.publisher = publisher or NullEventPublisher()
        self.filler = filler_token_ids or list(FILLER_TEXT.encode())
        self.metrics = EngineMetrics(model_name, kv.block_size, engine=data_parallel_rank)
        self.registry = self.metrics.registry
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.healthy = True
        self.steps = 0
        self._mamba = any(isinstance(spec, MambaSpec) for spec in kv.specs)

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
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        forced_token: int | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes.

        Closing the iterator early (client gone) aborts the request and frees its blocks.
        """
        if self._stopping:
            raise RuntimeError("engine is shutting down")
        lora_name, lora_path = lora if lora is not None else (None, None)
        req = self.kv.new_request(
            request_id,
            prompt_token_ids,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
        )
        seq = _Seq(req, max_tokens, forced_token)
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
                if self.kv.has_pending_work:
                    # Copies in flight: keep stepping so their events come out (vLLM's
                    # engine steps while the connector has pending push work).
                    await asyncio.sleep(self.timing.step_seconds(0, 0, 0))
                else:
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
        """One scheduler step in vLLM 0.33's order (``Scheduler.schedule``)."""
        self._drop_aborted()
        self.kv.new_step_starts()
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        scheduled: list[tuple[_Seq, int]] = []
        prefill_tokens = decode_seqs = loaded_tokens = 0
        preempted = False

        # 1. Running requests first, in admission order; preempt the newest to make room.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            req = seq.request
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n = min(n, max_len - 1 - req.num_computed_tokens)
            n = self._mamba_split(req, n)
            if n <= 0:
                i += 1
                continue
            ok = True
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                for s_, k in scheduled:
                    if s_ is victim:
                        budget += k
                scheduled = [(s_, k) for s_, k in scheduled if s_ is not victim]
                if victim is seq:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((seq, n))
            budget -= n
            if req.num_computed_tokens > req.num_prompt_tokens:
                decode_seqs += 1
            else:
                prefill_tokens += n
            i += 1

        # 2. Admit waiting requests, first come first served, unless this step preempted:
        # the whole sequence must fit; the first that does not blocks the rest.
        # A request whose CPU hit reads chunks still being written is skipped this step
        # (vLLM: the connector's lookup returns None) and keeps its place in the queue.
        skipped: list[_Seq] = []
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            req = seq.request
            gpu, cpu = self.kv.lookup(req)
            if self.kv.cpu_hit_must_wait(req, gpu, cpu):
                skipped.append(self.waiting.popleft())
                continue
            start = min(gpu + cpu, req.num_tokens - 1)
            n = self._mamba_split(req, min(req.num_tokens - start, budget), start)
            if n <= 0:
                break
            try:
                ok = self.kv.allocate_slots(req, n, gpu, cpu, full_sequence_must_fit=True)
            except LookupError:  # a CPU chunk went away between lookup and load
                ok = self.kv.allocate_slots(req, n, gpu, 0, full_sequence_must_fit=True)
                cpu = 0
            if not ok:
                if not self.running and not scheduled and self.kv.is_idle():
                    # Nothing holds a block and it still does not fit: it never will
                    # (the server checks max_model_len against the pool at start-up).
                    self.waiting.popleft()
                    msg = f"request needs more KV blocks than the engine has ({n} tokens)"
                    logger.error("%s: %s", req.request_id, msg)
                    seq.out.put_nowait(RuntimeError(msg))
                    continue
                break
            self.waiting.popleft()
            if seq.gpu_hit < 0:  # cached_tokens: the first admission's hit
                seq.gpu_hit, seq.cpu_hit = gpu, cpu
                self.metrics.on_admitted(req.num_prompt_tokens, gpu, cpu)
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            prefill_tokens += n
            loaded_tokens += cpu

        self.waiting.extendleft(reversed(skipped))

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
            tok = seq.forced_token
            if tok is None:
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

    def _mamba_split(self, req: Request, n: int, hit: int = 0) -> int:
        """vLLM's ``_mamba_block_aligned_split``: in "align" mode a prefill chunk ends on
        a block boundary (where a state can be cached) and stops at the prompt's last
        reusable boundary and at a shared-prefix junction. 0: cannot advance this step."""
        if not self._mamba:
            return n
        bs = self.kv.alignment
        start = req.num_computed_tokens + hit
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if start >= prefill_end:
            return n
        last_cache = (req.num_tokens - 1) // bs * bs
        end = start + n
        if end < prefill_end:
            aligned = end // bs * bs
            if aligned > start or bs <= self.config.max_num_batched_tokens:
                end = aligned
        junction = req.shared_prefix_boundary
        stops = (
            (start // bs + 1) * bs if start % bs else 0,
            last_cache,
            start + (junction - start) // bs * bs if start < junction < end else 0,
        )
        end = min((x for x in stops if start < x < end), default=end)
        return max(end - start, 0)

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
        self.kv.free(seq.request, finished=False)
        seq.request.num_computed_tokens = 0
        seq.request.num_preemptions += 1
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

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """``KVCacheManager.reset_prefix_cache``; its ``AllBlocksCleared`` goes out with the
        next step's batch, as vLLM's does."""
        return self.kv.reset_prefix_cache(reset_external)

    # ---- metrics --------------------------------------------------------------------

    def refresh_metrics(self) -> None:
        offload = self.kv.offload
        cpu_usage = (
            offload.num_used_chunks / offload.config.num_cpu_chunks
            if offload is not None and offload.config.num_cpu_chunks
            else 0.0
        )
        self.metrics.refresh(len(self.running), len(self.waiting), self.kv.usage, cpu_usage)
