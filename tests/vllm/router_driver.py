"""Drive a real ``kvroute router`` in front of real vLLM servers, and compare its
predictions with what vLLM reports.

The router is a subprocess (real uvicorn, real HTTP, real ZMQ), configured the way a user
would: each ``--instance`` is the URL plus the exact ``--kv-events-config`` JSON its vLLM
was started with. Between sequential requests the driver waits until the router has
applied every batch vLLM has published (the newest seq comes from vLLM's own replay
socket), so a mismatch is a wrong prediction, not a race with the event stream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from harness import REPO, VllmServer, fetch_replay, free_port
from workload import Step, next_messages, record_reply

ADMIN_TOKEN = "conformance"


@dataclass
class Outcome:
    kind: str
    instance: str
    predicted: int
    cached: int
    best_elsewhere: int = 0  # the best other candidate's predicted hit, from /debug/route

    @property
    def exact(self) -> bool:
        return self.predicted == self.cached


def _server_url(target: str) -> str:
    """The server of a routing target: itself, or a data-parallel rank's ``URL#dpR``."""
    return target.split("#", 1)[0]


@dataclass
class RouterUnderTest:
    servers: list[VllmServer]
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    zero_config: bool = False  # each --instance is the URL alone (read /kv_event_sources)
    proc: subprocess.Popen | None = None
    port: int = 0
    _seen: dict[str, int] = field(default_factory=dict)  # instance -> newest seq published

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"router-{self.port}.log"

    def start(self, *args: str) -> RouterUnderTest:
        self.port = free_port()
        cmd = [sys.executable, "-m", "kvroute_cli.main", "router", "--port", str(self.port)]
        cmd += ["--health-interval", "0.5"]
        for s in self.servers:
            spec = s.url if self.zero_config else f"{s.url}={json.dumps(s.kv_events_config)}"
            cmd += ["--instance", spec]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN}
        with self.log_path.open("wb") as fh:
            self.proc = subprocess.Popen(
                [*cmd, *args],
                cwd=REPO,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**env, **self.env},
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("router did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # ---- state ---------------------------------------------------------------------------

    def instances(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(
            f"{self.url}/admin/instances",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=5,
        )
        r.raise_for_status()
        return {i["url"]: i for i in r.json()["instances"]}

    def sync(self, timeout: float = 15.0) -> None:
        """Wait until the router has applied everything each vLLM published so far: every
        routing target the router follows (a server, or each of its data-parallel ranks,
        ``URL#dpR``), read from vLLM's replay endpoint as the router resolved it."""
        ours = {s.url for s in self.servers}
        for url, inst in self.instances().items():
            if not inst.get("replay") or _server_url(url) not in ours:
                continue
            start = self._seen.get(url, -1) + 1
            for seq, _ in fetch_replay(inst["replay"], start):
                self._seen[url] = max(self._seen.get(url, -1), seq)
        deadline = time.monotonic() + timeout
        while True:
            got = self.instances()
            lag = {
                u: (got[u]["last_seq"], want)
                for u, want in self._seen.items()
                if got[u]["last_seq"] is None or got[u]["last_seq"] < want
            }
            if not lag:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"router behind vLLM (applied, published): {lag}")
            time.sleep(0.02)

    def forget_seqs(self, server: VllmServer) -> None:
        """A restarted vLLM (each of its ranks) counts from 0 again."""
        for url in [u for u in self._seen if _server_url(u) == server.url]:
            del self._seen[url]

    # ---- requests ------------------------------------------------------------------------

    def body(self, step: Step, messages: list[dict[str, str]] | None) -> tuple[str, dict]:
        body = {"model": self.servers[0].served_model_name} | step.body()
        if messages is not None:
            body.pop("prompt", None)
            body["messages"] = messages
            return "/v1/chat/completions", body
        return "/v1/completions", body

    def layouts(self) -> dict[str, tuple[int, str]]:
        """Per instance, the hash block size the router uses now and where it came from."""
        body = {"prompt": "x" * 64, "model": self.servers[0].served_model_name}
        r = httpx.post(f"{self.url}/debug/route", json=body, timeout=30)
        r.raise_for_status()
        return {
            c["instance"]: (c["hash_block_size"], c["layout_source"])
            for c in r.json()["candidates"]
        }

    def explain(self, path: str, body: dict[str, Any]) -> dict[str, int]:
        r = httpx.post(f"{self.url}/debug/route", json=body, timeout=30)
        r.raise_for_status()
        return {c["instance"]: c["gpu_tokens"] + c["cpu_tokens"] for c in r.json()["candidates"]}

    def send(self, step: Step, messages: list[dict[str, str]] | None) -> tuple[Outcome, str]:
        path, body = self.body(step, messages)
        options = self.explain(path, body)
        r = httpx.post(f"{self.url}{path}", json=body, timeout=300)
        r.raise_for_status()
        return self._outcome(step, r, options), _text(r.json())

    def _outcome(self, step: Step, r: httpx.Response, options: dict[str, int]) -> Outcome:
        inst = r.headers["x-kvroute-instance"]
        details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
        others = [v for u, v in options.items() if u != inst]
        return Outcome(
            step.kind,
            inst,
            int(r.headers["x-kvroute-predicted-hit"]),
            int(details.get("cached_tokens") or 0),
            max(others, default=0),
        )

    def run_sequential(
        self, steps: list[Step], chats: dict[int, list[dict[str, str]]]
    ) -> list[Outcome]:
        """Send ``steps`` one after another, each after the router applied the events of
        the one before (chat steps continue ``chats`` with vLLM's replies)."""
        rows = []
        for step in steps:
            msgs = next_messages(chats, step, None) if step.chat_key is not None else None
            out, reply = self.send(step, msgs)
            record_reply(chats, step, reply)
            rows.append(out)
            self.sync()
        return rows

    async def send_all(self, steps: list[Step], spacing_s: float = 0.05) -> list[Outcome]:
        """Send ``steps`` as one burst: all in flight together, arriving ``spacing_s``
        apart. Sent in the same instant, two requests on separate connections can reach
        vLLM's scheduler in either order -- which decides which of them hits -- and no
        router can know that order; 50 ms keeps the arrival order without waiting for any
        request's prefill (hundreds of ms) or events."""
        import asyncio

        async with httpx.AsyncClient(timeout=300) as client:

            async def one(i: int, step: Step) -> Outcome:
                await asyncio.sleep(i * spacing_s)
                path, body = self.body(step, None)
                r = await client.post(f"{self.url}{path}", json=body)
                r.raise_for_status()
                return self._outcome(step, r, {})

            return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(steps))))


def _text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"]
