"""The Compose stack for real: docker/compose.local.yaml brought up by
``scripts/docker-stack.sh up`` (what ``make compose-up`` runs: installs Docker when missing,
starts dockerd, builds the images from a debootstrap'ed base and a wheelhouse when no
registry is reachable), driven over HTTP through both routers, one engine container
stopped under load and started again, then torn down.

Cold (no images, no cache) this takes a few minutes: the debootstrap roots and the
wheelhouse are cached under ~/.cache/kvroute/docker, the images by Docker; warm, the stack is
up in about half a minute.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "scripts" / "docker-stack.sh"
LOCAL = REPO / "docker" / "compose.local.yaml"
PROJECT = "kvroute-local"
ROUTERS = ("http://127.0.0.1:8080", "http://127.0.0.1:8081")
MODEL = "kvroute-sim"
log = logging.getLogger(__name__)
pytestmark = pytest.mark.slow


def _docker() -> str:
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker") or ""


def _docker_run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_docker(), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def _engines() -> dict[str, str]:
    """Engine service -> its URL, from the compose file (``--port=P`` on loopback)."""
    out = {}
    for name, svc in yaml.safe_load(LOCAL.read_text())["services"].items():
        cmd = [str(a) for a in svc.get("command") or []]
        if cmd and cmd[0] == "engine":
            port = next(a.split("=", 1)[1] for a in cmd if a.startswith("--port="))
            out[name] = f"http://127.0.0.1:{port}"
    return out


ENGINES = _engines()


def _container(service: str) -> str:
    r = _docker_run(
        "ps",
        "-aq",
        "--filter",
        f"label=com.docker.compose.project={PROJECT}",
        "--filter",
        f"label=com.docker.compose.service={service}",
    )
    ids = r.stdout.split()
    assert len(ids) == 1, f"{service}: containers {ids} ({r.stderr})"
    return ids[0]


def _stack(cmd: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(STACK), cmd], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def stack() -> Any:
    t0 = time.monotonic()
    up = _stack("up", timeout=840)
    assert up.returncode == 0, f"docker-stack.sh up failed:\n{up.stderr[-6000:]}"
    assert up.stdout.split() == list(ROUTERS), up.stdout  # the router URLs it prints
    log.info("stack up in %.0f s", time.monotonic() - t0)
    try:
        yield
    finally:
        _stack("down", timeout=180)


def _body(prompt: str, stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


def _complete(client: httpx.Client, base: str, prompt: str, stream: bool) -> httpx.Response:
    """One completion; raises AssertionError unless it was answered in full."""
    if not stream:
        r = client.post(f"{base}/v1/completions", json=_body(prompt, False))
        assert r.status_code == 200, (r.status_code, r.text[:300])
        choice = r.json()["choices"][0]
        assert choice["text"] and choice["finish_reason"], r.text[:300]
        return r
    with client.stream("POST", f"{base}/v1/completions", json=_body(prompt, True)) as r:
        assert r.status_code == 200, (r.status_code, r.read()[:300])
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks and not any("error" in c for c in chunks), chunks[-1:]
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), chunks
    return r


def _credited(router: str, prompt: str, engine: str) -> int | None:
    """The GPU tokens of ``prompt`` the router's index (not its speculation) credits to
    ``engine``: what the engine's own KV events put in the shared Redis index. None while
    the router's health checks have the engine down (not a candidate)."""
    r = httpx.post(f"{router}/debug/route", json=_body(prompt, False), timeout=10)
    r.raise_for_status()
    found = [c for c in r.json()["candidates"] if c["instance"] == engine]
    return int(found[0]["index_score"][0]) if found else None


def _wait_credit(prompt: str, engine: str, positive: bool = True, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = {router: _credited(router, prompt, engine) for router in ROUTERS}
        if all(v is not None and (v > 0) == positive for v in got.values()):
            return
        assert time.monotonic() < deadline, f"{engine}: credited {got}, want > 0: {positive}"
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _prompt(tag: str) -> str:
    return f"{tag} {uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 12


@pytest.mark.timeout(900)
def test_router_image_has_no_torch_and_engine_image_has_cpu_torch(stack):
    sizes = {}
    for kind in ("router", "engine", "redis"):
        r = _docker_run("image", "inspect", "-f", "{{.Size}}", f"kvroute-{kind}:local")
        sizes[kind] = int(r.stdout) / 1e6
    log.info("image sizes (MB): %s", {k: round(v) for k, v in sizes.items()})
    code = "import importlib.util as u; print(u.find_spec('torch') is not None)"
    probe = ("run", "--rm", "--network", "none", "--entrypoint", "python")
    r = _docker_run(*probe, "kvroute-router:local", "-c", code)
    assert r.stdout.strip() == "False", (r.stdout, r.stderr)
    r = _docker_run(*probe, "kvroute-engine:local", "-c", "import torch; print(torch.__version__)")
    assert r.stdout.strip() == "2.13.0+cpu", (r.stdout, r.stderr)
    # Where this machine builds the native hasher (scripts/test.sh says so), the router
    # image carries it too: docker-images.sh builds the kvroute wheel here (docker/dist).
    if os.environ.get("KVROUTE_REQUIRE_NATIVE"):
        code = "from events.hashing import native_hashing; print(native_hashing())"
        r = _docker_run(*probe, "kvroute-router:local", "-c", code)
        assert r.stdout.strip() == "True", (r.stdout, r.stderr)
    assert sizes["router"] < sizes["engine"] / 3, sizes
    status = _stack("status", timeout=30).stdout.split("\n")
    assert sorted(ln for ln in status if ln) == sorted(
        f"{s} running healthy" for s in ("redis", *ENGINES, "router-0", "router-1")
    )


@pytest.mark.timeout(300)
def test_both_routers_answer_and_credit_hits_from_every_engines_events(stack):
    """A prompt cached on each engine (sent to it directly) is credited by both routers
    through the shared Redis index, and a repeat through either router goes to that engine
    and is served from its cache; streaming and non-streaming both answered."""
    prompts = {name: _prompt(name) for name in ENGINES}
    with httpx.Client(timeout=30) as client:
        for name, url in ENGINES.items():
            _complete(client, url, prompts[name], stream=False)
        for name, url in ENGINES.items():
            _wait_credit(prompts[name], url)
        answered = 0
        for i, (name, url) in enumerate(ENGINES.items()):
            for j, router in enumerate(ROUTERS):
                stream = (i + j) % 2 == 1
                r = _complete(client, router, prompts[name], stream)
                answered += 1
                assert r.headers["x-kvroute-instance"] == url, (router, name)
                assert int(r.headers["x-kvroute-predicted-hit"]) > 0, (router, name)
                if not stream:
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    log.info("credit check: %d routed repeats answered from their holder", answered)


class Load:
    """Requests through both routers from a few threads, streaming and not, until stopped:
    every one must be answered in full."""

    def __init__(self, threads: int = 6) -> None:
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = self.answered = 0
        self.failures: list[str] = []
        self.done_at: list[float] = []
        self.by_engine: Counter[str] = Counter()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, worker: int) -> None:
        prefixes = [_prompt(f"load-{k}") for k in range(4)]
        with httpx.Client(timeout=60) as client:
            n = 0
            while not self.stop.is_set():
                router = ROUTERS[(worker + n) % 2]
                prompt = f"{prefixes[n % 4]} worker {worker} turn {n}"
                with self.lock:
                    self.sent += 1
                try:
                    r = _complete(client, router, prompt, stream=n % 2 == 0)
                except (AssertionError, httpx.HTTPError) as exc:
                    with self.lock:
                        self.failures.append(f"{router}: {exc!r}"[:300])
                else:
                    with self.lock:
                        self.answered += 1
                        self.done_at.append(time.monotonic())
                        self.by_engine[r.headers.get("x-kvroute-instance", "?")] += 1
                n += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)

    def wait_answered(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.answered < n:
            assert time.monotonic() < deadline, f"only {self.answered} answered: {self.failures}"
            time.sleep(0.05)


@pytest.mark.timeout(300)
def test_engine_container_stopped_under_load_loses_nothing_and_its_index_is_rebuilt(stack):
    name = "engine-1"
    url, container = ENGINES[name], _container(name)
    before = _prompt("before-stop")
    httpx.post(f"{url}/v1/completions", json=_body(before, False), timeout=30).raise_for_status()
    _wait_credit(before, url)

    t0 = time.monotonic()
    with Load() as load:
        load.wait_answered(20)
        stopped_at = time.monotonic()
        r = _docker_run("stop", "-t", "20", container, timeout=60)
        assert r.returncode == 0, r.stderr
        stop_s = time.monotonic() - stopped_at
        load.wait_answered(load.answered + 40)  # served by the other two meanwhile
        r = _docker_run("start", container)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 90
        while not _healthy(url):
            assert time.monotonic() < deadline, f"{name} did not come back"
            time.sleep(0.2)
        restarted_at = time.monotonic()
        # The restarted engine's first batches reset its entries (a new publisher
        # incarnation) and the routers send it traffic again.
        after = _prompt("after-restart")
        httpx.post(f"{url}/v1/completions", json=_body(after, False), timeout=30)
        _wait_credit(after, url)
        _wait_credit(before, url, positive=False)  # its old cache is gone: not credited
        load.wait_answered(load.answered + 30)
    elapsed = time.monotonic() - t0
    during = sum(stopped_at <= t <= restarted_at for t in load.done_at)
    log.info(
        "under load: sent %d, answered %d, lost %d in %.1f s (stop took %.1f s, %d answered "
        "while %s was down or restarting); per engine %s",
        load.sent,
        load.answered,
        len(load.failures),
        elapsed,
        stop_s,
        during,
        name,
        dict(load.by_engine),
    )
    assert not load.failures, load.failures[:5]
    assert load.answered == load.sent
    assert during >= 40
    assert set(load.by_engine) == set(ENGINES.values()), load.by_engine


@pytest.mark.timeout(300)
def test_compose_down_removes_every_container_and_volume(stack):
    t0 = time.monotonic()
    down = _stack("down", timeout=180)
    assert down.returncode == 0, down.stderr
    log.info("stack down in %.1f s", time.monotonic() - t0)
    r = _docker_run("ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}")
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout
    r = _docker_run("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}")
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout
    for router in ROUTERS:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{router}/health", timeout=2)
