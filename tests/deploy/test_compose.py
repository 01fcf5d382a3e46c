"""docker/compose.yaml and docker/Dockerfile, checked without a Docker engine.

Every command of our services runs through the real ``kvroute`` CLI -- option parsing,
typer/click validation and each command's own settings validation -- with the server's
``serve`` replaced by a recorder, so nothing listens. The recorded settings then have to
line up: routers name every engine by service name and port, their events/replay
endpoints are the ports the engines bind, the index host is the Redis service, hashing
settings agree, health checks probe the port each service serves, only routers publish
ports (on 127.0.0.1, each once).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
REDIS_DEFAULT_PORT = 6379
PACKAGES = ("events", "engine_adapter", "router", "bench", "kvroute_cli")
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())  # safe_load resolves anchors and << merges
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _ours(service: dict[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("kvroute")


def _dockerfile(service: dict[str, Any]) -> Path:
    build = service["build"]
    context = (COMPOSE.parent / (build if isinstance(build, str) else build["context"])).resolve()
    name = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    return context / name


@dataclass
class Parsed:
    command: str  # engine | router
    settings: Any  # EngineSettings | RouterSettings, as the command would serve them


@pytest.fixture(scope="module")
def parsed(compose: dict[str, Any]) -> dict[str, Parsed]:
    """Run each of our services' command through the CLI with ``serve`` recorded."""
    import engine_adapter.sim.server as engine_server
    import router.server as router_server
    from kvroute_cli.main import app

    mp = pytest.MonkeyPatch()
    out: dict[str, Parsed] = {}
    try:
        for key in [k for k in os.environ if k.startswith("KVROUTE_")]:
            mp.delenv(key)  # the compose file alone must configure the services
        for name, svc in compose["services"].items():
            if not _ours(svc):
                continue
            cmd = svc.get("command")
            assert isinstance(cmd, list) and cmd, f"{name}: command must be an exec-form list"
            calls: list[Parsed] = []
            mp.setattr(
                engine_server,
                "serve",
                lambda s, log_level="info", _c=calls: _c.append(Parsed("engine", s)),
            )
            mp.setattr(router_server, "serve", lambda s, _c=calls: _c.append(Parsed("router", s)))
            result = CliRunner().invoke(app, [str(a) for a in cmd])
            assert result.exit_code == 0, (
                f"{name}: `kvroute {shlex.join(map(str, cmd))}` is not a valid invocation:\n"
                f"{result.output}\n{result.exception!r}"
            )
            assert len(calls) == 1 and calls[0].command == cmd[0], f"{name}: {calls}"
            out[name] = calls[0]
    finally:
        mp.undo()
    return out


def _by_kind(parsed: dict[str, Parsed], kind: str) -> dict[str, Any]:
    return {name: p.settings for name, p in parsed.items() if p.command == kind}


def _endpoint_port(endpoint: str) -> int:
    m = re.fullmatch(r"tcp://([^:]+):(\d+)", endpoint)
    assert m, f"not a tcp://host:port endpoint: {endpoint!r}"
    return int(m.group(2))


def test_compose_has_redis_three_swa_engines_and_two_routers(compose, parsed):
    engines = _by_kind(parsed, "engine")
    routers = _by_kind(parsed, "router")
    redis = [
        n for n, s in compose["services"].items() if str(s.get("image", "")).startswith("redis:")
    ]
    assert len(redis) == 1
    assert len(engines) == 3 and len(routers) == 2
    assert {s.profile for s in engines.values()} == {"swa-hybrid"}


def test_every_kvroute_service_uses_the_image_built_from_our_dockerfile(compose):
    ours = {n: s for n, s in compose["services"].items() if _ours(s)}
    assert ours
    for name, svc in ours.items():
        assert "build" in svc, f"{name}: no build section"
        assert _dockerfile(svc) == DOCKER / "Dockerfile", f"{name}: {_dockerfile(svc)}"
        assert svc.get("image") == ours[next(iter(ours))].get("image"), "one image for all"


def test_engines_publish_events_and_replay_on_all_interfaces(parsed):
    for name, s in _by_kind(parsed, "engine").items():
        assert s.host == "0.0.0.0", f"{name}: other containers cannot reach {s.host}"
        ev = s.kv_events
        assert ev is not None and ev.enable_kv_cache_events, f"{name}: KV events disabled"
        assert ev.endpoint.startswith("tcp://*:"), f"{name}: {ev.endpoint} must bind"
        assert ev.replay_endpoint and ev.replay_endpoint.startswith("tcp://*:"), name
        ports = {s.port, _endpoint_port(ev.endpoint), _endpoint_port(ev.replay_endpoint)}
        assert len(ports) == 3, f"{name}: HTTP, events and replay ports must differ: {ports}"


def test_router_instances_name_engine_services_ports_and_endpoints(parsed):
    from router.config import parse_instance

    engines = _by_kind(parsed, "engine")
    routers = _by_kind(parsed, "router")
    for rname, r in routers.items():
        assert r.host == "0.0.0.0", f"{rname}: published port would not reach {r.host}"
        seen = set()
        for text in r.instances:
            spec = parse_instance(text)
            url = urlparse(spec.url)
            host = url.hostname
            assert host in engines, f"{rname}: {spec.url} is not an engine service"
            eng = engines[host]
            assert url.port == eng.port, f"{rname}: {spec.url} but {host} serves :{eng.port}"
            for ep, bound in (
                (spec.events, eng.kv_events.endpoint),
                (spec.replay, eng.kv_events.replay_endpoint),
            ):
                assert ep is not None, f"{rname}: {text} lacks an events/replay endpoint"
                assert urlparse(ep.replace("tcp://", "http://")).hostname == host, (rname, ep)
                assert _endpoint_port(ep) == _endpoint_port(bound), (
                    f"{rname}: {ep} but {host} binds {bound}"
                )
            seen.add(host)
        assert seen == set(engines), f"{rname} routes to {sorted(seen)}, not every engine"


def test_routers_share_the_redis_service_as_index(compose, parsed):
    services = compose["services"]
    routers = _by_kind(parsed, "router")
    indexes = {r.index for r in routers.values()}
    assert len(indexes) == 1, f"replicas must share one index: {indexes}"
    url = urlparse(indexes.pop())
    assert url.scheme == "redis"
    assert str(services.get(url.hostname, {}).get("image", "")).startswith("redis:"), url
    redis_cmd = [str(a) for a in services[url.hostname].get("command") or []]
    port = int(redis_cmd[redis_cmd.index("--port") + 1]) if "--port" in redis_cmd else 6379
    assert (url.port or REDIS_DEFAULT_PORT) == port


def test_router_hashing_and_model_agree_with_every_engine(parsed):
    from engine_adapter.profiles import get_profile

    engines = _by_kind(parsed, "engine")
    for rname, r in _by_kind(parsed, "router").items():
        for ename, e in engines.items():
            # The router learns block sizes from events; its default must still agree.
            engine_bs = get_profile(e.profile, block_size=e.block_size, layout=e.layout).block_size
            assert r.block_size == engine_bs, (rname, ename)
            assert r.hash_algo == e.hash_algo, (rname, ename)
            assert r.seed == e.seed, (rname, ename)
            assert r.model == e.model, (rname, ename)
            if e.profile == "swa-hybrid":
                assert r.default_layout == f"swa:{e.sliding_window}", (rname, r.default_layout)


def _health_port(service: dict[str, Any], name: str) -> int:
    test = service.get("healthcheck", {}).get("test")
    assert isinstance(test, list) and test[0] == "CMD", f"{name}: healthcheck must be CMD form"
    if test[1] == "python":
        code = test[test.index("-c") + 1]
        compile(code, f"{name}-healthcheck", "exec")  # valid Python, at least
        m = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)/health\b", code)
        assert m, f"{name}: healthcheck does not probe /health on loopback: {code}"
        return int(m.group(1))
    raise AssertionError(f"{name}: unexpected healthcheck {test}")


def test_healthchecks_probe_the_port_each_service_serves(compose, parsed):
    services = compose["services"]
    for name, p in parsed.items():
        assert _health_port(services[name], name) == p.settings.port, name
    for name, svc in services.items():
        if not _ours(svc):
            assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"


def test_routers_start_after_redis_and_engines_are_healthy(compose, parsed):
    services = compose["services"]
    engines = set(_by_kind(parsed, "engine"))
    for rname, r in _by_kind(parsed, "router").items():
        deps = services[rname].get("depends_on")
        assert isinstance(deps, dict), f"{rname}: depends_on needs conditions"
        redis = urlparse(r.index).hostname
        assert set(deps) >= engines | {redis}, f"{rname}: depends on {sorted(deps)}"
        for dep, cond in deps.items():
            assert cond.get("condition") == "service_healthy", (rname, dep)
            assert services[dep].get("healthcheck"), f"{dep} has no healthcheck to wait for"


def test_only_routers_and_grafana_publish_ports_on_loopback_each_once(compose, parsed):
    services = compose["services"]
    routers = _by_kind(parsed, "router")
    # The operator's UIs: routers (API, /dashboard) and Grafana (on its default port).
    published = {**{name: s.port for name, s in routers.items()}, "grafana": 3000}
    host_ports: list[int] = []
    for name, svc in services.items():
        ports = svc.get("ports") or []
        if name not in published:
            assert not ports, f"{name} must not be published"
            continue
        assert ports, f"{name} not published"
        for entry in ports:
            ip, host, container = str(entry).split(":")
            assert ip == "127.0.0.1", f"{name}: {entry} must bind loopback"
            assert int(container) == published[name], f"{name}: {entry}"
            host_ports.append(int(host))
    assert len(host_ports) == len(set(host_ports)), f"host ports collide: {host_ports}"


def test_dockerfile_slim_python_nonroot_entrypoint_kvroute():
    text = (DOCKER / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0].startswith("FROM python:3.11-slim")
    entry = [ln for ln in lines if ln.startswith("ENTRYPOINT")]
    assert len(entry) == 1 and json.loads(entry[0].removeprefix("ENTRYPOINT")) == ["kvroute"]
    user = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] not in ("root", "0"), "the image must not run as root"
    assert any("download.pytorch.org/whl/cpu" in ln for ln in lines), "CPU torch wheels"
    # Every package pyproject installs is copied into the build.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    includes = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {ln.split()[1] for ln in lines if ln.startswith("COPY ")}
    for pattern in includes:
        assert pattern.rstrip("*") in copied, f"Dockerfile does not COPY {pattern}"


def test_wheel_ships_the_redis_index_lua_script(tmp_path):
    """The image installs a wheel (not the source tree): non-Python files the code opens
    must be package data, or the routers' Redis index fails inside the container."""
    src = tmp_path / "src"  # build from a copy: no build/ or egg-info left in the repo
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [*PIP_WHEEL, "-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("kvroute-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {
        str(p.relative_to(REPO))
        for pkg in ("events", "engine_adapter", "router", "bench", "kvroute_cli")
        for p in (REPO / pkg).rglob("*")
        if p.is_file() and p.suffix in (".lua", ".json", ".yaml", ".toml", ".txt")
    }
    assert needed, "expected at least router/index/redis_index.lua"
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"
