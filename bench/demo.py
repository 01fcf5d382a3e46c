"""``kvroute up``: a whole deployment on loopback, a short multi-turn workload, a summary.

Why a demo runs real processes: the point is to show what a user would get -- N simulated
engines publishing vLLM KV events over ZMQ, the router ingesting them into its index and
routing over HTTP -- not an in-process shortcut. Every child logs to a temp dir (kept and
named when something fails) and is stopped with SIGTERM (then SIGKILL) whatever happens.

Per policy the workload runs against fresh engines (cold caches), so rows are comparable.
Per request we record the instance the router chose (``x-kvroute-instance``), client-side
TTFT, what the engine really reused (``usage.kv_hit``, ``cached_tokens``) and what the router
predicted for it (``x-kvroute-predicted-hit``, else the router's prediction-error
histogram), and reduce that to hit ratio, TTFT p50/p90 and prediction accuracy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from router.policy import POLICIES, make_policy

__all__ = [
    "DemoConfig",
    "DemoError",
    "RequestRecord",
    "run_up",
    "summarize",
]

logger = logging.getLogger(__name__)

MODEL = "kvroute-sim"
KVROUTE = [sys.executable, "-m", "kvroute_cli.main"]
# The layout the router assumes for an instance until its events teach it the real one.
_LAYOUTS = {"full": "full", "swa-hybrid": "swa:1024", "mamba-hybrid": "mamba"}

# A small fixed vocabulary: prompts are deterministic in the seed and readable in logs.
_VOCAB = (
    "cache block prefix token window router engine layer attention sliding mamba state "
    "offload tier event stream replay index redis score policy latency queue prefill decode "
    "batch hash chunk evict reuse hybrid group memory transfer request turn answer context"
)
_WORDS = tuple(_VOCAB.split())


class DemoError(RuntimeError):
    """The deployment could not start or the workload failed; ``log_dir`` has the logs."""

    def __init__(self, message: str, log_dir: Path | None = None) -> None:
        super().__init__(f"{message} (logs: {log_dir})" if log_dir else message)
        self.log_dir = log_dir


@dataclass(frozen=True)
class DemoConfig:
    """The deployment and workload. Defaults: ~40 requests, well under a minute on 2 cores.

    Sizes are chosen so the demo means something on the swa-hybrid profile: system prompts
    are longer than the 1024-token window (so the sliding-window group decides the hit, not
    the full-attention one), and an engine's GPU pool holds about a third of all the
    conversations, so a router that spreads every conversation everywhere evicts into the
    CPU tier while one that keeps conversations together does not.
    """

    engines: int = 3
    profile: str = "swa-hybrid"
    index: str = "memory"  # memory | redis (private redis-server) | redis://...
    policies: tuple[str, ...] = ("cost",)
    conversations: int = 8
    turns: int = 5
    system_prompts: int = 3
    system_tokens: int = 1400  # the byte tokenizer: one char = one token
    user_tokens: int = 160
    max_tokens: int = 24
    think_s: float = 0.05  # pause between a reply and the next turn (wall seconds)
    stagger_s: float = 0.15  # conversation i starts at i * stagger_s
    gpu_blocks: int = 512
    cpu_blocks: int = 1024
    block_size: int = 16
    hash_algo: str = "sha256_cbor"
    time_scale: float = 1.0
    seed: int = 0
    startup_timeout_s: float = 60.0
    request_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("engines must be >= 1")
        if self.conversations < 1 or self.turns < 1 or self.system_prompts < 1:
            raise ValueError("conversations, turns and system_prompts must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"unknown policies {unknown}; expected some of {POLICIES}")
        if self.profile not in _LAYOUTS:
            raise ValueError(f"unknown profile {self.profile!r}; expected one of {list(_LAYOUTS)}")
        if not (self.index in ("memory", "redis") or self.index.startswith("redis://")):
            raise ValueError(f"index must be memory, redis or redis://..., got {self.index!r}")

    @property
    def total_requests(self) -> int:
        return self.conversations * self.turns


@dataclass
class RequestRecord:
    """One chat request as the client saw it."""

    conversation: int
    turn: int
    instance: str | None = None
    status: int = 0
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    predicted_hit_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class Observer:
    """Progress hooks (the CLI draws a Rich bar from them); the default only logs."""

    def round_started(self, policy: str, total_requests: int) -> None:
        logger.info("[%s] %d requests against fresh engines", policy, total_requests)

    def phase(self, policy: str, text: str) -> None:
        logger.info("[%s] %s", policy, text)

    def request_done(self, policy: str, record: RequestRecord) -> None:
        logger.debug("[%s] conversation %d turn %d done", policy, record.conversation, record.turn)


# ---- workload -------------------------------------------------------------------------


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
                    hit = usage.get("kv_hit") or {}
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


# ---- results --------------------------------------------------------------------------


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def prediction_accuracy_from_metrics(text: str) -> float | None:
    """Share of exact predictions from the router's ``kvroute_router_predictions_total``
    counter (``result`` = exact | over | under); None when it has seen no request."""
    from prometheus_client.parser import text_string_to_metric_families

    by_result: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "kvroute_router_predictions":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                by_result[sample.labels.get("result", "")] += int(sample.value)
    total = sum(by_result.values())
    return by_result["exact"] / total if total else None


def summarize(
    policy: str, records: Sequence[RequestRecord], metrics_text: str | None = None
) -> dict[str, Any]:
    """One table row: hit ratio, TTFT percentiles, prediction accuracy, spread."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    # Policies that ignore the index (round_robin, least_loaded) predict nothing; a "0"
    # header from them says nothing about the index, so no accuracy for them.
    predicts = make_policy(policy).uses_scores
    with_pred = [r for r in ok if r.predicted_hit_tokens is not None] if predicts else []
    accuracy: float | None = None
    source: str | None = None
    errors = [
        (r.predicted_hit_tokens or 0) - r.gpu_hit_tokens - r.cpu_hit_tokens for r in with_pred
    ]
    if with_pred:
        accuracy, source = sum(e == 0 for e in errors) / len(with_pred), "header"
    elif metrics_text and predicts:
        accuracy = prediction_accuracy_from_metrics(metrics_text)
        source = "metrics" if accuracy is not None else None
    p50, p90 = _quantile(ttfts, 0.5), _quantile(ttfts, 0.9)
    return {
        "policy": policy,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "gpu_hit_tokens": sum(r.gpu_hit_tokens for r in ok),
        "cpu_hit_tokens": sum(r.cpu_hit_tokens for r in ok),
        "hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": None if p50 is None else p50 * 1e3,
        "ttft_p90_ms": None if p90 is None else p90 * 1e3,
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else None,
        "prediction_accuracy": accuracy,
        "prediction_source": source,
        "predicted_requests": len(with_pred),
        "predicted_over": sum(e > 0 for e in errors),  # router credited more than reused
        "predicted_under": sum(e < 0 for e in errors),
        "per_instance": dict(sorted(Counter(r.instance or "?" for r in ok).items())),
    }


# ---- processes ------------------------------------------------------------------------


class _Ports:
    """Free loopback ports, never the same one twice in a run."""

    def __init__(self) -> None:
        self._used: set[int] = set()

    def take(self) -> int:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in self._used:
                self._used.add(port)
                return port


@functools.cache
def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook (Linux): the child gets SIGTERM if ``kvroute up`` itself dies, even
    by SIGKILL, so no engine outlives the demo holding its ports. libc is resolved here, in
    the parent: the hook runs between fork and exec, where loading a library could deadlock
    (the progress bar's thread may hold the loader lock)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return hook


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    log: Path


@dataclass
class _Deployment:
    """The children of one round; stopped in reverse dependency order."""

    log_dir: Path
    children: list[_Child] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)  # every port the children listen on

    def start(self, name: str, cmd: list[str]) -> _Child:
        log = self.log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as fh:
            fh.write(f"$ {' '.join(cmd)}\n".encode())
            fh.flush()
            # Own session: a terminal Ctrl-C reaches only us; we stop children in order.
            proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        child = _Child(name, proc, log)
        self.children.append(child)
        logger.debug("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
        return child

    def stop(self, timeout: float) -> None:
        """SIGTERM in groups (router, engines, redis), wait, SIGKILL what is left.

        A second Ctrl-C during the graceful part kills everything at once and re-raises.
        """
        groups: list[list[_Child]] = [
            [c for c in self.children if c.name.startswith("router")],
            [c for c in self.children if c.name.startswith("engine")],
            [c for c in self.children if c.name.startswith("redis")],
        ]
        try:
            for group in groups:
                for c in group:
                    if c.proc.poll() is None:
                        c.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + timeout
                for c in group:
                    try:
                        c.proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        logger.warning("%s ignored SIGTERM for %.0fs; killing it", c.name, timeout)
                        c.proc.kill()
                        c.proc.wait(5)
        except BaseException:
            for c in self.children:
                if c.proc.poll() is None:
                    c.proc.kill()
            for c in self.children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(5)
            raise


def _tail(log: Path, chars: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-chars:]
    return ""


def _wait_http(url: str, child: _Child, deadline: float, log_dir: Path) -> None:
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise DemoError(
                f"{child.name} exited with {child.proc.returncode}:\n{_tail(child.log)}", log_dir
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.1)
    raise DemoError(f"{child.name}: {url} not healthy in time", log_dir)


def _wait_redis(port: int, child: _Child, deadline: float, log_dir: Path) -> None:
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise DemoError(f"redis-server exited with {child.proc.returncode}", log_dir)
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(64).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise DemoError("redis-server did not answer PING in time", log_dir)


def _kv_events_config(events_port: int, replay_port: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )


@dataclass(frozen=True)
class _Engine:
    url: str
    events: str
    replay: str

    @property
    def instance_arg(self) -> str:
        return f"{self.url}={self.events},replay={self.replay}"


def _start_round(
    cfg: DemoConfig, policy: str, dep: _Deployment, ports: _Ports
) -> tuple[str, list[_Engine]]:
    """Start redis (if private), engines and the router; return the router URL when healthy."""
    deadline = time.monotonic() + cfg.startup_timeout_s
    index = cfg.index
    if index == "redis":
        redis_bin = shutil.which("redis-server")
        if redis_bin is None:
            raise DemoError("--index redis needs redis-server on PATH (or pass redis://...)")
        rport = ports.take()
        cmd = [redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no"]
        child = dep.start(f"redis-{policy}", cmd)
        dep.ports.append(rport)
        _wait_redis(rport, child, deadline, dep.log_dir)
        index = f"redis://127.0.0.1:{rport}/0"

    engines: list[_Engine] = []
    engine_children: list[tuple[_Child, _Engine]] = []
    for i in range(cfg.engines):
        port, ev, rp = ports.take(), ports.take(), ports.take()
        cmd = [*KVROUTE, "--log-level", "WARNING", "engine", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--profile", cfg.profile, "--name", f"127.0.0.1:{port}"]
        cmd += ["--gpu-blocks", str(cfg.gpu_blocks), "--cpu-blocks", str(cfg.cpu_blocks)]
        cmd += ["--block-size", str(cfg.block_size), "--time-scale", str(cfg.time_scale)]
        cmd += ["--prefix-caching-hash-algo", cfg.hash_algo, "--model", MODEL]
        cmd += ["--kv-events-config", _kv_events_config(ev, rp), "--log-level", "warning"]
        e = _Engine(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")
        engine_children.append((dep.start(f"engine-{i}-{policy}", cmd), e))
        dep.ports += [port, ev, rp]
        engines.append(e)

    rport = ports.take()
    cmd = [*KVROUTE, "--log-level", "WARNING", "router", "--host", "127.0.0.1"]
    cmd += ["--port", str(rport), "--index", index, "--policy", policy, "--model", MODEL]
    cmd += ["--block-size", str(cfg.block_size), "--hash-algo", cfg.hash_algo]
    cmd += ["--health-interval", "1", "--default-layout", _LAYOUTS[cfg.profile]]
    for e in engines:
        cmd += ["--instance", e.instance_arg]
    # Engines first: the router's subscribers then connect to live publishers.
    for child, e in engine_children:
        _wait_http(f"{e.url}/health", child, deadline, dep.log_dir)
    router = dep.start(f"router-{policy}", cmd)
    dep.ports.append(rport)
    router_url = f"http://127.0.0.1:{rport}"
    _wait_http(f"{router_url}/health", router, deadline, dep.log_dir)
    return router_url, engines


def _router_metrics(router_url: str) -> str | None:
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"{router_url}/metrics", timeout=5.0, trust_env=False)
        if r.status_code == 200:
            return r.text
    return None


def run_up(
    engines: int = 3,
    profile: str = "swa-hybrid",
    index: str = "memory",
    policies: Sequence[str] = ("cost",),
    turns: int = 5,
    conversations: int = 8,
    time_scale: float = 1.0,
    seed: int = 0,
    *,
    observer: Observer | None = None,
    keep_logs: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Run the demo once per policy, each against fresh engines; return the report.

    ``overrides`` are further :class:`DemoConfig` fields (gpu_blocks, max_tokens, ...).
    Raises :class:`DemoError` (logs kept) when the deployment fails to start or a request
    fails; children are stopped in every case, Ctrl-C included.
    """
    cfg = DemoConfig(
        engines=engines,
        profile=profile,
        index=index,
        policies=tuple(policies),
        turns=turns,
        conversations=conversations,
        time_scale=time_scale,
        seed=seed,
        **overrides,
    )
    obs = observer or Observer()
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-up-"))
    ports = _Ports()
    rows: list[dict[str, Any]] = []
    pids: list[int] = []
    failed = True
    t_start = time.perf_counter()
    try:
        for policy in cfg.policies:
            dep = _Deployment(log_dir)
            try:
                obs.round_started(policy, cfg.total_requests)
                obs.phase(policy, f"starting {cfg.engines} engines and the router")
                router_url, engine_list = _start_round(cfg, policy, dep, ports)
                obs.phase(policy, "running the workload")
                t0 = time.perf_counter()
                records = asyncio.run(
                    run_workload(router_url, cfg, lambda r, p=policy: obs.request_done(p, r))
                )
                wall = time.perf_counter() - t0
                row = summarize(policy, records, _router_metrics(router_url))
                row["workload_s"] = wall
                row["router"] = router_url
                row["engines"] = [e.url for e in engine_list]
                row["ports"] = list(dep.ports)
                row["records"] = [asdict(r) for r in records]
                rows.append(row)
                bad = [r for r in records if not r.ok]
                if bad:
                    raise DemoError(
                        f"[{policy}] {len(bad)} of {len(records)} requests failed; first: "
                        f"{bad[0].status} {bad[0].error}",
                        log_dir,
                    )
            finally:
                obs.phase(policy, "shutting down")
                pids += [c.proc.pid for c in dep.children]
                dep.stop(cfg.stop_timeout_s)
                obs.phase(policy, "stopped")
        failed = False
    finally:
        if failed or keep_logs:
            logger.warning("child process logs kept in %s", log_dir)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    config = asdict(cfg)
    config["policies"] = list(cfg.policies)
    return {
        "config": config,
        "rows": rows,
        "pids": pids,
        "wall_s": time.perf_counter() - t_start,
        "log_dir": str(log_dir) if keep_logs else None,
    }
