"""``kvroute bench fleet``'s processes: the fleet's publishers, its HTTP engines, the router.

Each runs as ``python -m bench.fleet_procs ROLE CONFIG_JSON`` and talks to the
orchestrator (``bench.fleet``) by lines: it prints one JSON object per step on stdout and
waits for a line on stdin before the next step.

* ``publishers``: one ``events.publisher.ZmqEventPublisher`` per instance (vLLM's
  publisher: PUB + ROUTER replay, ``buffer_steps`` covering the backlog), publishes every
  instance's batches, then ``ready``; ``churn-minute RATE`` publishes a simulated minute
  of store/evict churn on every instance (``RATE`` block events per instance-second) and
  says each instance's last seq, ``churn-end`` evicts what churn left; ``stop`` ends it.
* ``engines``: one port per instance answering ``/health``, ``/metrics`` (a vLLM-sized
  body), ``/v1/models`` and ``/v1/completions`` at once (``bench.replay.upstream``).
* ``router``: the real router (``router.http.server.build_app`` under uvicorn, in process), cold:
  it meets the fleet's backlog through replay. Steps: ``ingested`` (rate, entries, RSS),
  ``idle`` (CPU of the idle router: health probing), ``decisions`` (in-process
  ``Router.decide`` on 240k-token prompts, each checked), ``serving`` (the proxy is
  measured from outside); ``catch-up SEQS`` waits until every instance's batch ``SEQS[i]``
  is applied and says RSS and entries (``caught-up``); ``done`` (peak RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.fleet_workload import HASH_ALGO, HASH_SEED, FleetShape, instance_batches, query
from events.structs import BlockRemoved, BlockStored, KVEventBatch

log = logging.getLogger("bench.fleet")


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _line() -> str:
    return sys.stdin.readline().strip()


def rss_kb(field: str = "VmRSS", pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def shape_of(cfg: dict[str, Any]) -> FleetShape:
    return FleetShape(**cfg["shape"])


# ---- publishers ---------------------------------------------------------------------------


def publishers_main(cfg: dict[str, Any]) -> None:
    from events.publisher import ZmqEventPublisher

    shape = shape_of(cfg)
    pubs = []
    blocks = entries = batches_n = 0
    t0 = time.perf_counter()
    for i, (ev, rp) in enumerate(zip(cfg["events"], cfg["replays"], strict=True)):
        batches, n_entries, n_blocks = instance_batches(shape, i)
        # The backlog (a cold router replays it) plus a margin: churn's batches roll it out
        # (an hour of a fleet's churn kept whole would be gigabytes).
        pub = ZmqEventPublisher(endpoint=ev, replay_endpoint=rp, buffer_steps=len(batches) + 256)
        ts = time.time()
        for b in batches:
            b.ts = ts
            pub.publish(b)
        pubs.append((pub, len(batches)))
        blocks, entries, batches_n = (
            blocks + n_blocks,
            entries + n_entries,
            batches_n + len(batches),
        )
        del batches
    for pub, n in pubs:  # every batch encoded and in the replay buffer
        deadline = time.monotonic() + 600
        while pub.published < n and time.monotonic() < deadline:
            time.sleep(0.01)
    _say({"step": "ready", "blocks": blocks, "entries": entries, "batches": batches_n,
          "seconds": time.perf_counter() - t0, "rss_kb": rss_kb()})  # fmt: skip
    churn = _Churn(shape, [n for _, n in pubs])
    while cmd := _line():
        if cmd.startswith("churn-minute"):
            rate = float(cmd.split()[1])
            blocks = churn.minute(pubs, rate)
            _say({"step": "churn-minute", "blocks": blocks, "last_seqs": churn.last_seqs()})
        elif cmd == "churn-end":
            blocks = churn.evict_all(pubs)
            _say({"step": "churn-end", "blocks": blocks, "last_seqs": churn.last_seqs()})
        elif cmd == "stop":
            break
    for pub, _ in pubs:
        pub.shutdown()


class _Churn:
    """Simulated minutes of an engine's cache churn on every instance: each step stores a
    fresh prompt (``step_blocks`` full-attention blocks and its sliding-window tail, with
    token ids, as vLLM sends them) and, past ``resident`` churned prompts, evicts the
    oldest (both groups): the index keeps its size while every block it held at the
    start of a minute is replaced within minutes. A minute is ``rate * 60`` block events
    per instance, published as fast as the process can, so an hour of a fleet's events
    costs minutes."""

    resident = 4

    def __init__(self, shape: FleetShape, published: list[int]) -> None:
        self.shape = shape
        self.rng = random.Random(shape.seed + 99)
        n_tokens = shape.step_blocks * shape.block_size
        self.tokens = [self.rng.randrange(1000) for _ in range(n_tokens)]
        self.held: list[list[list[int]]] = [[] for _ in published]
        self.count = list(published)  # batches published per instance so far

    def last_seqs(self) -> list[int]:
        return [n - 1 for n in self.count]

    def _store(self, pub: Any, i: int) -> int:
        s = self.shape
        hs = [self.rng.getrandbits(64) for _ in range(s.step_blocks)]
        tail = hs[-s.window_blocks :]
        pub.publish(KVEventBatch(ts=time.time(), events=[
            _churn_stored(s, hs, self.tokens, 0),
            _churn_stored(s, tail, self.tokens[-len(tail) * s.block_size :], 1),
        ]))  # fmt: skip
        self.held[i].append(hs)
        self.count[i] += 1
        return len(hs) + len(tail)

    def _evict(self, pub: Any, i: int) -> int:
        hs = self.held[i].pop(0)
        tail = hs[-self.shape.window_blocks :]
        pub.publish(KVEventBatch(ts=time.time(), events=[
            BlockRemoved(block_hashes=hs, medium="GPU", group_idx=0),
            BlockRemoved(block_hashes=tail, medium="GPU", group_idx=1),
        ]))  # fmt: skip
        self.count[i] += 1
        return len(hs) + len(tail)

    def minute(self, pubs: list[tuple[Any, int]], rate: float) -> int:
        budget = rate * 60
        blocks = 0
        for i, (pub, _) in enumerate(pubs):
            done = 0
            while done < budget:
                done += self._store(pub, i)
                if len(self.held[i]) > self.resident:
                    done += self._evict(pub, i)
            blocks += done
        return blocks

    def evict_all(self, pubs: list[tuple[Any, int]]) -> int:
        blocks = 0
        for i, (pub, _) in enumerate(pubs):
            while self.held[i]:
                blocks += self._evict(pub, i)
        return blocks


def _churn_stored(shape: FleetShape, hashes: list[int], tokens: list[int], group: int) -> Any:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
        block_size=shape.block_size, lora_id=None, medium="GPU", lora_name=None,
        group_idx=group, kv_cache_spec_kind="full_attention" if group == 0 else "sliding_window",
        kv_cache_spec_sliding_window=None if group == 0 else shape.window,
    )  # fmt: skip


# ---- engines ------------------------------------------------------------------------------


def engines_main(cfg: dict[str, Any]) -> None:
    import uvloop

    from bench.replay.upstream import RequestProtocol, _Http, _response

    metrics = _vllm_metrics(cfg.get("model", "kvroute-sim"), cfg["shape"]["block_size"])
    models = json.dumps(
        {
            "object": "list",
            "data": [
                {"id": cfg.get("model", "kvroute-sim"), "object": "model", "max_model_len": 262_144}
            ],
        }
    ).encode()

    class Engine(_Http):
        def on_message_complete(self) -> None:
            path = self.url.split(b"?")[0]
            if path == b"/metrics":
                self.body.clear()
                assert self.transport is not None
                self.transport.write(_response(b"200 OK", metrics, b"text/plain"))
            elif path == b"/v1/models":
                self.body.clear()
                assert self.transport is not None
                self.transport.write(_response(b"200 OK", models))
            else:
                super().on_message_complete()

    assert issubclass(Engine, RequestProtocol)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [
            await loop.create_server(Engine, "127.0.0.1", port, backlog=1024)
            for port in cfg["ports"]
        ]
        _say({"step": "ready"})
        await asyncio.to_thread(_line)
        for s in servers:
            s.close()

    uvloop.run(main())


_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, "+Inf")  # fmt: skip


def _vllm_metrics(model: str, block_size: int) -> bytes:
    """A /metrics body shaped like vLLM 0.32's (~25 KB: the gauges the router reads plus
    the histograms an engine exports)."""
    lab = f'engine="0",model_name="{model}"'
    lines = [
        f"vllm:num_requests_running{{{lab}}} 0.0",
        f"vllm:num_requests_waiting{{{lab}}} 0.0",
        f"vllm:kv_cache_usage_perc{{{lab}}} 0.42",
        f"vllm:prefix_cache_queries_total{{{lab}}} 1000000.0",
        f"vllm:prefix_cache_hits_total{{{lab}}} 700000.0",
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        f'enable_prefix_caching="True",{lab}}} 1.0',
    ]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "inter_token_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        lines.append(f"# HELP vllm:{name} Histogram of {name}.")
        lines.append(f"# TYPE vllm:{name} histogram")
        for le in _BUCKETS:
            lines.append(f'vllm:{name}_bucket{{{lab},le="{le}"}} 12345.0')
        lines.append(f"vllm:{name}_sum{{{lab}}} 4321.0")
        lines.append(f"vllm:{name}_count{{{lab}}} 12345.0")
    return ("\n".join(lines) + "\n").encode()


# ---- router -------------------------------------------------------------------------------


def router_main(cfg: dict[str, Any]) -> None:
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_router(cfg))


async def _router(cfg: dict[str, Any]) -> None:
    import uvicorn

    from router.config import RouterSettings
    from router.http.protocol import HttpProtocol
    from router.http.server import build_app

    shape = shape_of(cfg)
    rss_start = rss_kb()
    specs = [
        f"http://127.0.0.1:{port}={ev},replay={rp}"
        for port, ev, rp in zip(cfg["ports"], cfg["events"], cfg["replays"], strict=True)
    ]
    # Churn replays a fleet's hour in minutes: the router's loop is saturated by design
    # for seconds at a time, and its probes' answers wait behind it. Probes are not what
    # churn measures: a down mark would drop the instance's residency and rebuild it from
    # a replay buffer that churn has rolled past.
    health = {"timeout_s": 30.0, "failures": 10} if cfg.get("churn") else {}
    settings = RouterSettings(
        port=cfg["router_port"], instances=specs, index=cfg.get("index", "memory"),
        block_size=shape.block_size, hash_algo=HASH_ALGO, seed=HASH_SEED,
        default_layout=f"swa:{shape.window}", log_level="warning", health=health,
    )  # fmt: skip
    app, state = build_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=settings.port,
            http=HttpProtocol,
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
    )
    t0, cpu0 = time.perf_counter(), time.process_time()
    serve = asyncio.create_task(server.serve())
    while not server.started:
        if serve.done():
            serve.result()
            raise RuntimeError("router did not start")
        await asyncio.sleep(0.005)
    want = cfg["last_seqs"]
    urls = [f"http://127.0.0.1:{p}" for p in cfg["ports"]]
    deadline = time.monotonic() + cfg.get("ingest_timeout_s", 1800)
    t_first = None  # the first batch applied: the router is up, its replays answered
    while True:
        seqs = [state.ingest.last_seq(u) for u in urls]
        if t_first is None and any(s is not None for s in seqs):
            t_first = time.perf_counter()
        behind = [u for u, s, w in zip(urls, seqs, want, strict=True) if (s or -1) < w]
        if not behind or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.002)
    t_end, cpu = time.perf_counter(), time.process_time() - cpu0
    stats = await _index_stats(state.index)
    _say({
        "step": "ingested", "seconds": t_end - (t_first or t0), "cold_seconds": t_end - t0,
        "cpu_seconds": cpu, "load": os.getloadavg()[0],
        "behind": len(behind), "entries": stats.get("entries"), "rss_start_kb": rss_start,
        "rss_kb": rss_kb(), "hwm_kb": rss_kb("VmHWM"),
    })  # fmt: skip
    if behind:
        raise RuntimeError(f"{len(behind)} instances never caught up")
    if cfg.get("ingest_only"):
        await asyncio.to_thread(_line)
        server.should_exit = True
        await serve
        return
    # Idle: ingest caught up, no requests; what remains is health probing.
    await asyncio.sleep(cfg.get("settle_s", 3.0))
    healthy = len(state.registry.healthy())
    c0, w0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(cfg["idle_s"])
    cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
    _say({"step": "idle", "cpu_share": cpu, "healthy": healthy, "rss_kb": rss_kb()})
    # Decisions, in process: each one checked.
    results = await _decisions(state, shape, cfg["decisions"], urls)
    results["rss_kb"] = rss_kb()
    _say({"step": "decisions", **results})
    _say({"step": "serving"})
    while cmd := await asyncio.to_thread(_line):
        if cmd.startswith("catch-up"):  # catch-up SEQS_JSON: apply up to them, then sample
            seqs = json.loads(cmd.split(None, 1)[1])
            t0, c0 = time.perf_counter(), time.process_time()
            pairs = list(zip(urls, seqs, strict=True))
            while any((state.ingest.last_seq(u) or -1) < w for u, w in pairs):
                await asyncio.sleep(0.002)
            stats = await _index_stats(state.index)
            _say({"step": "caught-up", "seconds": time.perf_counter() - t0,
                  "cpu_seconds": time.process_time() - c0, "rss_kb": rss_kb(),
                  "entries": stats.get("entries")})  # fmt: skip
        elif cmd == "stop":
            break
    _say({"step": "done", "hwm_kb": rss_kb("VmHWM"), "rss_kb": rss_kb()})
    server.should_exit = True
    await serve


async def _index_stats(index: Any) -> dict[str, Any]:
    inner = getattr(index, "inner", index)
    stats = inner.stats()
    if asyncio.iscoroutine(stats):
        stats = await stats
    return stats


async def _decisions(state: Any, shape: FleetShape, n: int, urls: list[str]) -> dict[str, Any]:
    # One request at a time: the router's peak memory is the router's, not the prompts'.
    qs = (query(shape, k, salt="decide") for k in range(n + shape.docs))
    times: list[float] = []
    cpu: list[float] = []  # the event loop thread's CPU: what contention does not inflate
    wrong: list[dict[str, Any]] = []
    checked = 0
    gc.collect()
    for k, q in enumerate(qs):
        body = {"model": "kvroute-sim", "prompt": q.tokens, "max_tokens": 1}
        t0, c0 = time.perf_counter(), time.thread_time()
        d = await state.router.decide(body, "completion", record=False, predict=False)
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        if k >= shape.docs:  # the first of each document also hashes its shared prefix
            times.append(dt)
            cpu.append(dc)
        chosen = d.decision.instance
        c = d.candidates[chosen]
        checked += 1
        if (chosen, c.gpu_tokens, c.cpu_tokens) != (urls[q.holder], q.gpu_tokens, q.cpu_tokens):
            wrong.append({"doc": q.doc, "chosen": chosen, "gpu": c.gpu_tokens,
                          "cpu": c.cpu_tokens, "want": [urls[q.holder], q.gpu_tokens,
                                                        q.cpu_tokens]})  # fmt: skip
    times.sort()
    cpu.sort()
    return {
        "cpu_p50_ms": statistics.median(cpu) * 1e3,
        "cpu_p99_ms": cpu[min(len(cpu) - 1, int(0.99 * len(cpu)))] * 1e3,
        "load": os.getloadavg()[0],
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3,
        "max_ms": times[-1] * 1e3,
        "timed": len(times),
        "checked": checked,
        "correct": checked - len(wrong),
        "wrong": wrong[:5],
    }


if __name__ == "__main__":
    role, path = sys.argv[1], sys.argv[2]
    config = json.loads(Path(path).read_text())
    with contextlib.suppress(KeyboardInterrupt):
        {"publishers": publishers_main, "engines": engines_main, "router": router_main}[role](
            config
        )
    os._exit(0)
