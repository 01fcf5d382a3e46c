"""Random request streams: the events must describe the cache exactly, at every step.

After every engine step the machine checks that (a) the residency implied by all events
so far -- per (group, block hash, tier), refcounted -- equals the pools' real contents,
and whenever a request is looked up, that (b) the hit the engine reports equals what the
shared hit rule (``events.groups`` / ``events.offload_hit``) gives over the event-implied
residency: what a router would predict.
"""

from __future__ import annotations

import random

from ea_helpers import EventState
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.offload import OffloadConfig
from engine_adapter.profiles import PROFILE_NAMES, get_profile
from engine_adapter.request import Request
from events.groups import longest_cache_hit
from events.offload_hit import offload_hit
from events.structs import MEDIUM_CPU, MEDIUM_GPU

BS = 4


class EngineMachine(RuleBasedStateMachine):
    kv: KVCacheManager

    @initialize(
        profile=st.sampled_from(PROFILE_NAMES),
        pool_per_group=st.booleans(),
        offload=st.builds(
            OffloadConfig,
            num_cpu_chunks=st.integers(4, 32),
            blocks_per_chunk=st.sampled_from([1, 2]),
            policy=st.sampled_from(["lru", "arc"]),
            self_describing=st.booleans(),
            offload_prompt_only=st.booleans(),
        ),
        num_blocks=st.integers(8, 24),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self, profile: str, pool_per_group: bool, offload: OffloadConfig, num_blocks: int, seed: int
    ) -> None:
        prof = get_profile(profile, block_size=BS, sliding_window=10, page_bytes=8)
        self.kv = KVCacheManager(
            prof, num_blocks, offload=offload, pool_per_group=pool_per_group, device="cpu"
        )
        # Copies complete (are observed) only when the machine releases them: deterministic.
        self.released: set[int] = set()
        transfer = self.kv.offload.transfer
        transfer.is_done = lambda job: job in self.released
        self.state = EventState()
        rng = random.Random(seed)
        self.prefixes = [[rng.randrange(50) for _ in range(n)] for n in (17, 28)]
        self.running: dict[str, Request] = {}
        self.next_id = 0
        self.lookups = 0

    # ---- helpers ------------------------------------------------------------------------

    def end_step(self) -> None:
        self.state.apply_batch(self.kv.step_events())

    def check_hit(self, req: Request) -> tuple[int, int]:
        kv, state = self.kv, self.state
        gpu_pred = state.pred(req, MEDIUM_GPU)
        want_gpu = longest_cache_hit(kv.specs, gpu_pred, req.num_tokens - 1)
        assert kv.get_computed_blocks(req) == want_gpu
        got = kv.lookup(req)
        if kv.cpu_hit_must_wait(req, *got):
            # The hit reads chunks still being copied (not announced yet): vLLM defers the
            # request until they are; only the GPU part is comparable now.
            return got[0], -1
        want = offload_hit(
            kv.specs, gpu_pred, state.pred(req, MEDIUM_CPU), req.num_tokens, kv.tokens_per_chunk
        )
        assert got == want, (got, want)
        self.lookups += 1
        return got

    def prompt(self, prefix: int, suffix: list[int]) -> list[int]:
        return [*self.prefixes[prefix], *suffix]

    def drop(self, req: Request, *, finished: bool = True) -> None:
        self.kv.free(req, finished=finished)
        self.running.pop(req.request_id, None)

    # ---- rules ----------------------------------------------------------------------------

    @rule(
        prefix=st.integers(0, 2),
        suffix=st.lists(st.integers(0, 50), max_size=5),
        chunk=st.integers(1, 64),
    )
    def admit(self, prefix: int, suffix: list[int], chunk: int) -> None:
        """A request sharing one of a few prefixes (prefix 2: unrelated tokens, which push
        other prefixes out of the GPU)."""
        if prefix == 2:
            rng = random.Random(self.next_id)
            prompt = [rng.randrange(1000, 2000) for _ in range(20 + len(suffix) * 4)]
        else:
            prompt = self.prompt(prefix, suffix)
        req = self.kv.new_request(f"r{self.next_id}", prompt)
        self.next_id += 1
        gpu, cpu = self.check_hit(req)
        if cpu < 0:  # waits for copies in flight
            self.end_step()
            return
        start = min(gpu + cpu, req.num_tokens - 1)
        n = min(chunk, req.num_tokens - start)
        if self.kv.allocate_slots(req, n, gpu, cpu):
            self.running[req.request_id] = req
        self.end_step()

    @rule(prefix=st.integers(0, 1), suffix=st.lists(st.integers(0, 50), max_size=5))
    def probe(self, prefix: int, suffix: list[int]) -> None:
        self.check_hit(self.kv.new_request("probe", self.prompt(prefix, suffix)))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 1000), chunk=st.integers(1, 48), token=st.integers(0, 50))
    def advance(self, pick: int, chunk: int, token: int) -> None:
        """One more prefill chunk, or one decode token once the prompt is done."""
        req = list(self.running.values())[pick % len(self.running)]
        if req.num_computed_tokens < req.num_tokens:
            n = min(chunk, req.num_tokens - req.num_computed_tokens)
        else:
            req.append_output_token_ids(token)
            n = 1
        if not self.kv.allocate_slots(req, n):
            self.drop(req, finished=False)  # preempted
        self.end_step()

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 1000))
    def finish(self, pick: int) -> None:
        self.drop(list(self.running.values())[pick % len(self.running)])
        self.end_step()

    @rule()
    def release_copies(self) -> None:
        self.released.update(self.kv.offload._jobs)
        self.end_step()

    @rule()
    def flush(self) -> None:
        self.kv.flush()
        self.end_step()

    @precondition(lambda self: not self.running)
    @rule()
    def reset_prefix_cache(self) -> None:
        # vLLM's default reset: AllBlocksCleared empties the GPU tier, the CPU tier stays
        # (and EventState keeps it, as the router's index does).
        assert self.kv.reset_prefix_cache()
        self.end_step()

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def events_describe_the_cache(self) -> None:
        if hasattr(self, "kv"):
            assert self.state.snapshot() == self.kv.residency()
            held = [
                b for m in self.kv.managers for blocks in m.req_blocks.values() for b in blocks if b
            ]
            for pool in self.kv._unique_pools:
                pool.check_invariants([b for b in held if pool.blocks[b.block_id] is b])

    def teardown(self) -> None:
        if hasattr(self, "kv"):
            self.kv.close()


EngineMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_random_request_streams_keep_events_and_cache_in_step = EngineMachine.TestCase
