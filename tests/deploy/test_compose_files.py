"""docker/compose.yaml (production-shaped) and docker/compose.local.yaml (the same
deployment with host networking, run for real by test_compose.py), checked without Docker.

Every command of our services runs through the real ``kvroute`` CLI -- option parsing,
typer/click validation and each command's own settings validation -- with the server's
``serve`` replaced by a recorder, so nothing listens. The recorded settings then have to
line up: routers name every engine by its address and port, their events/replay endpoints
are the ones the engines bind, the index host is the Redis service, hashing settings agree,
health checks probe the port each service serves, only routers (and Grafana) publish
ports; and the local file describes the production file's deployment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib
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
LOCAL = DOCKER / "compose.local.yaml"
REDIS_DEFAULT_PORT = 6379


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())  # safe_load resolves anchors and << merges
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _ours(service: dict[str, Any]) -> bool:
    """A service that runs ``kvroute`` (engine or router)."""
    cmd = service.get("command") or []
    return bool(cmd) and str(cmd[0]) in ("engine", "router")


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
    return _parse(compose)


@pytest.fixture(scope="module")
def local() -> dict[str, Any]:
    data = yaml.safe_load(LOCAL.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def local_parsed(local: dict[str, Any]) -> dict[str, Parsed]:
    return _parse(local)


def _parse(compose: dict[str, Any]) -> dict[str, Parsed]:
    """Run each of our services' command through the CLI with ``serve`` recorded."""
    import engine_adapter.sim.server as engine_server
    import router.http.server as router_server
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


def test_engines_and_routers_use_their_targets_of_our_dockerfile(compose, parsed):
    services = compose["services"]
    for kind in ("engine", "router"):
        names = list(_by_kind(parsed, kind))
        for name in names:
            svc = services[name]
            assert _dockerfile(svc) == DOCKER / "Dockerfile", f"{name}: {_dockerfile(svc)}"
            assert svc["build"].get("target") == kind, f"{name}: builds {svc['build']}"
            assert svc.get("image") == f"kvroute-{kind}:local", name


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
    from router.fleet.specs import parse_instance

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


def _stages(text: str) -> dict[str, list[str]]:
    """Instructions per build stage (FROM ... AS name), comments and blanks dropped."""
    stages: dict[str, list[str]] = {}
    current = ""
    for ln in text.splitlines():
        ln = ln.strip()
        if not ln or ln.startswith("#"):
            continue
        if ln.startswith("FROM "):
            current = ln.split()[-1] if " AS " in ln else ln.split()[1]
            stages[current] = []
        stages.setdefault(current, []).append(ln)
    return stages


def test_dockerfile_base_image_arg_targets_nonroot_entrypoint_kvroute():
    text = (DOCKER / "Dockerfile").read_text()
    stages = _stages(text)
    assert stages[""][0] == "ARG BASE_IMAGE=python:3.11-slim", "public slim Python by default"
    assert stages["runtime"][0] == "FROM ${BASE_IMAGE} AS runtime"
    for target in ("router", "engine"):
        lines = stages[target]
        assert lines[0] == f"FROM runtime AS {target}", target
        entry = [ln for ln in lines if ln.startswith("ENTRYPOINT")]
        assert len(entry) == 1 and json.loads(entry[0].removeprefix("ENTRYPOINT")) == ["kvroute"]
        user = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
        assert user and user[-1] not in ("root", "0"), f"{target} must not run as root"
        assert f"COPY --from={target}-deps /opt/kvroute /opt/kvroute" in lines, target
    assert any("import torch" in ln for ln in stages["router"]), "router image proves no torch"
    # The CPU torch index when no wheelhouse is given; never CUDA.
    assert "download.pytorch.org/whl/cpu" in (DOCKER / "pip-install.sh").read_text()
    # Every package pyproject installs is copied into the wheel's build.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    includes = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {ln.split()[1] for ln in stages["dist"] if ln.startswith("COPY ")}
    # ... and let through the build context (BuildKit reads the Dockerfile's own ignore file).
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    for pattern in includes:
        assert pattern.rstrip("*") in copied, f"Dockerfile does not COPY {pattern}"
        assert f"!{pattern.rstrip('*')}/**" in ignore, f"the build context leaves out {pattern}"


# ---- compose.local.yaml: the same deployment, host networking, loopback ---------------------

ENGINE_LOCAL_ONLY = {"host", "port", "kv_events"}
ROUTER_LOCAL_ONLY = {"host", "port", "instances", "index"}


def _fields(settings: Any, skip: set[str]) -> dict[str, Any]:
    data = settings.model_dump() if hasattr(settings, "model_dump") else vars(settings)
    return {k: v for k, v in data.items() if k not in skip}


def test_local_stack_runs_the_production_deployment(parsed, local_parsed):
    """Same services and the same engine and router settings, but for where they listen."""
    for kind, skip in (("engine", ENGINE_LOCAL_ONLY), ("router", ROUTER_LOCAL_ONLY)):
        prod, here = _by_kind(parsed, kind), _by_kind(local_parsed, kind)
        assert set(here) == set(prod), kind
        for name in prod:
            assert _fields(here[name], skip) == _fields(prod[name], skip), name


def test_local_stack_uses_host_networking_loopback_and_distinct_ports(local, local_parsed):
    services = local["services"]
    assert set(services) == {"redis", *local_parsed}
    ports: list[int] = []
    for name, svc in services.items():
        assert svc.get("network_mode") == "host", f"{name}: no bridge networks here"
        assert not svc.get("ports") and not svc.get("networks"), name
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    redis_cmd = [str(a) for a in services["redis"]["command"]]
    assert redis_cmd[redis_cmd.index("--bind") + 1] == "127.0.0.1"
    redis_port = int(redis_cmd[redis_cmd.index("--port") + 1])
    assert services["redis"]["image"] == "kvroute-redis:local"
    assert redis_port != REDIS_DEFAULT_PORT, "the machine's own Redis has 6379"
    ports.append(redis_port)
    for name, p in local_parsed.items():
        s = p.settings
        assert s.host == "127.0.0.1", f"{name} binds {s.host}"
        assert services[name]["image"] == f"kvroute-{p.command}:local", name
        assert _health_port(services[name], name) == s.port, name
        ports.append(s.port)
        if p.command == "engine":
            assert s.kv_events.endpoint.startswith("ipc:///run/kvroute/"), name
            assert s.kv_events.replay_endpoint.startswith("tcp://127.0.0.1:"), name
            ports.append(_endpoint_port(s.kv_events.replay_endpoint))
        assert "ipc:/run/kvroute" in services[name].get("volumes", []), name
    assert len(ports) == len(set(ports)), f"ports collide: {sorted(ports)}"
    routers = _by_kind(local_parsed, "router")
    assert sorted(r.port for r in routers.values()) == [8080, 8081]
    assert {r.index for r in routers.values()} == {f"redis://127.0.0.1:{redis_port}/0"}


def test_local_routers_follow_every_engine_as_it_publishes(local, local_parsed):
    from router.fleet.specs import parse_instance

    engines = _by_kind(local_parsed, "engine")
    services = local["services"]
    for rname, r in _by_kind(local_parsed, "router").items():
        specs = {parse_instance(t).url: parse_instance(t) for t in r.instances}
        assert set(specs) == {f"http://127.0.0.1:{e.port}" for e in engines.values()}, rname
        for e in engines.values():
            spec = specs[f"http://127.0.0.1:{e.port}"]
            assert (spec.events, spec.replay) == (
                e.kv_events.endpoint,
                e.kv_events.replay_endpoint,
            ), rname
        deps = services[rname]["depends_on"]
        assert set(deps) == {"redis", *engines}, rname
        assert {d["condition"] for d in deps.values()} == {"service_healthy"}
