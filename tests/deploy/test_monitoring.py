"""docker/'s Prometheus and Grafana, checked against what kvroute really exports.

Every metric the Grafana dashboard queries must be on a real router's or a real simulated
engine's ``/metrics`` (both started here, on loopback, with a request routed through), and
every label it filters or groups by must exist on that metric as Prometheus stores it
(router series: the exported ``instance`` relabelled to ``engine``; targets add
``instance`` and ``job``). Prometheus must scrape every router and engine service of
compose.yaml, and Grafana's provisioning must point at that Prometheus and that dashboard.
With a ``prometheus`` binary on PATH, every query also runs against a live one.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvtest import engines, free_port, start_router

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "kvroute.json"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards" / "kvroute.yaml"
ROUTER_JOB, ENGINE_JOB = "kvroute-router", "kvroute-engine"
TARGET_LABELS = {"instance", "job"}

# ---- PromQL: metric names and the labels each one is filtered or grouped by -------------

_FUNCS = {
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev", "stdvar",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "abs",
    "clamp_min", "clamp_max", "label_replace", "label_values", "vector", "scalar", "time",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "changes", "resets",
}  # fmt: skip
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset"}  # fmt: skip
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _matching_paren(s: str, i: int) -> int:
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j
    raise AssertionError(f"unbalanced parentheses in {s!r}")


def promql_refs(expr: str) -> tuple[set[str], dict[str, set[str]]]:
    """(metric names, {metric: label names it is matched on or aggregated by})."""
    label_values = re.findall(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)", expr)
    expr = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", expr)
    s = re.sub(r"\$\{?\w+\}?", "0", expr)  # Grafana variables ($__rate_interval, $router)
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', s)  # string literals
    s = re.sub(r"\[[^\]]*\]", "", s)  # range and subquery selectors
    labels: dict[str, set[str]] = {}
    names: set[str] = set()
    # name{matchers}: the matchers' label names belong to that metric.
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", s):
        names.add(m.group(1))
        keys = re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2))
        labels.setdefault(m.group(1), set()).update(keys)
    bare = re.sub(r"\{[^}]*\}", "", s)
    # by/without (labels) (expr) or agg (expr) by (labels): labels of every metric inside.
    # (on/ignoring lists are not checked: the dashboard matches no vectors by label.)
    groupings = []
    for m in re.finditer(r"\b(by|without)\s*\(([^)]*)\)", bare):
        keys = {k.strip() for k in m.group(2).split(",") if k.strip()}
        after = bare[m.end() :].lstrip()
        if after.startswith("("):
            scope = after[: _matching_paren(after, 0) + 1]
        else:  # agg (expr) by (...): the aggregation's argument precedes the clause
            before = bare[: m.start()].rstrip()
            assert before.endswith(")"), expr
            depth, k = 0, len(before) - 1
            while k >= 0:
                depth += {")": 1, "(": -1}.get(before[k], 0)
                if depth == 0:
                    break
                k -= 1
            scope = before[k:]
        groupings.append((keys, scope))
    no_lists = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    for m in _IDENT.finditer(no_lists):
        word = m.group(0)
        rest = no_lists[m.end() :].lstrip()
        if word in _KEYWORDS or rest.startswith("("):
            assert word in _FUNCS or word in _KEYWORDS, f"unknown function {word!r} in {expr!r}"
            continue
        names.add(word)
    for keys, scope in groupings:
        for word in _IDENT.findall(re.sub(r"\{[^}]*\}", "", scope)):
            if word in names:
                labels.setdefault(word, set()).update(keys)
    for name, label in label_values:  # a Grafana variable's values: that metric's label
        labels.setdefault(name, set()).add(label)
    return names, labels


def test_promql_reference_extraction():
    names, labels = promql_refs(
        "histogram_quantile(0.9, sum by (engine, le) (rate(kvroute_router_ttft_seconds_bucket"
        '{instance=~"$router",outcome!="ok"}[$__rate_interval]))) / on (job) '
        "sum(rate(vllm:prompt_tokens_total[5m])) by (instance)"
    )
    assert names == {"kvroute_router_ttft_seconds_bucket", "vllm:prompt_tokens_total"}
    assert labels == {
        "kvroute_router_ttft_seconds_bucket": {"instance", "outcome", "engine", "le"},
        "vllm:prompt_tokens_total": {"instance"},
    }
    assert promql_refs("label_values(kvroute_router_instance_healthy, instance)") == (
        {"kvroute_router_instance_healthy"},
        {"kvroute_router_instance_healthy": {"instance"}},
    )


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            out.append((f"variable {var['name']}", q["query"] if isinstance(q, dict) else q))
    return out


# ---- what the real processes export -----------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+", re.M)
_TYPE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (\w+)", re.M)


def exported(text: str, declared_labels: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{sample name: its label names}`` of an exposition. A family declared without
    samples yet (a labelled counter nothing incremented) counts with its sample names and
    the labels its collector declares."""
    out: dict[str, set[str]] = {}
    for m in _SAMPLE.finditer(text):
        keys = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
        out.setdefault(m.group(1), set()).update(keys)
    for m in _TYPE.finditer(text):
        name, kind = m.group(1), m.group(2)
        if kind == "histogram":
            names = [f"{name}_bucket", f"{name}_count", f"{name}_sum"]
            if any(n in out for n in names):
                continue  # has samples: its real sample names stand (no _sum with negative le)
        elif name in out:
            continue
        else:
            names = [name]
        for n in names:
            base = name.removesuffix("_total")
            le = {"le"} if n.endswith("_bucket") else set()
            out[n] = set(declared_labels.get(base, set())) | le
    return out


def _declared_router_labels() -> dict[str, set[str]]:
    from prometheus_client import CollectorRegistry

    from router.ingest.metrics import IngestMetrics
    from router.metrics import RouterMetrics

    reg = CollectorRegistry()
    objs = [*vars(RouterMetrics(reg)).values(), *vars(IngestMetrics(reg)).values()]
    return {o._name: set(o._labelnames) for o in objs if hasattr(o, "_labelnames")}


@pytest.fixture(scope="module")
def metrics(tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    """A request routed through a real router to a real engine; both /metrics, parsed."""
    tmp = tmp_path_factory.mktemp("monitoring")
    with engines(tmp, 1, "--profile", "swa-hybrid", "--time-scale", "20") as engs:
        router = start_router(tmp, engs)
        try:
            r = httpx.post(
                f"{router.url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            router_text = httpx.get(f"{router.url}/metrics", timeout=10).text
            engine_text = httpx.get(f"{engs[0].url}/metrics", timeout=10).text
        finally:
            router.stop()
    return {
        ROUTER_JOB: exported(router_text, _declared_router_labels()),
        ENGINE_JOB: exported(engine_text, {}),
    }


def test_every_metric_in_the_grafana_dashboard_is_exported(metrics):
    queries = _dashboard_queries()
    assert len(queries) >= 20
    missing = {}
    for title, expr in queries:
        names, _ = promql_refs(expr)
        assert names, f"{title}: no metric in {expr!r}"
        gone = sorted(n for n in names if not any(n in m for m in metrics.values()))
        if gone:
            missing[title] = gone
    assert not missing, f"metrics no router or engine exports: {missing}"


def test_every_label_the_dashboard_uses_exists_as_prometheus_stores_it(metrics):
    def stored(job: str, labels: set[str]) -> set[str]:
        if job == ROUTER_JOB:  # prometheus.yml: exported instance -> engine
            labels = {"engine" if k == "instance" else k for k in labels}
        return labels | TARGET_LABELS

    bad = []
    for title, expr in _dashboard_queries():
        _, used = promql_refs(expr)
        for name, keys in used.items():
            job = ROUTER_JOB if name in metrics[ROUTER_JOB] else ENGINE_JOB
            if name not in metrics[job]:
                continue  # not exported at all: the test above says so
            unknown = keys - stored(job, metrics[job][name])
            if unknown:
                bad.append(f"{title}: {name} has no label {sorted(unknown)}")
    assert not bad, "\n".join(bad)


def test_router_series_are_scraped_with_the_engine_relabelled(metrics):
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    relabel = jobs[ROUTER_JOB]["metric_relabel_configs"]
    assert {"source_labels": ["exported_instance"], "regex": "(.+)", "target_label": "engine"} in (
        relabel
    )
    assert {"regex": "exported_instance", "action": "labeldrop"} in relabel
    # Every router series about an engine carries it in `instance` (relabelled above).
    per_engine = [n for n, labels in metrics[ROUTER_JOB].items() if "instance" in labels]
    assert {"kvroute_router_requests_total", "kvroute_ingest_lag_seconds"} <= set(per_engine)


# ---- compose, Prometheus and Grafana line up ----------------------------------------------


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _flag(cmd: list[str], name: str) -> str | None:
    for i, arg in enumerate(cmd):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(cmd):
            return cmd[i + 1]
    return None


def test_prometheus_scrapes_every_router_and_engine_service():
    services = _compose()["services"]
    want: dict[str, set[str]] = {ROUTER_JOB: set(), ENGINE_JOB: set()}
    for name, svc in services.items():
        cmd = [str(a) for a in svc.get("command") or []]
        if cmd and cmd[0] in ("router", "engine"):
            job = ROUTER_JOB if cmd[0] == "router" else ENGINE_JOB
            want[job].add(f"{name}:{_flag(cmd, '--port')}")
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    got = {
        j["job_name"]: {t for sc in j["static_configs"] for t in sc["targets"]}
        for j in cfg["scrape_configs"]
    }
    assert got == want
    assert all(j.get("metrics_path", "/metrics") == "/metrics" for j in cfg["scrape_configs"])


def _mounts(svc: dict[str, Any]) -> dict[str, Path]:
    out = {}
    for vol in svc.get("volumes", []):
        src, dst = str(vol).split(":")[:2]
        assert src.startswith("./"), f"{vol}: bind-mount a file of docker/"
        path = (DOCKER / src).resolve()
        assert path.exists(), f"{vol}: {path} missing"
        out[dst] = path
    return out


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard():
    services = _compose()["services"]
    prom, graf = services["prometheus"], services["grafana"]
    assert _mounts(prom)["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    prom_cmd = [str(a) for a in prom["command"]]
    assert _flag(prom_cmd, "--config.file") == "/etc/prometheus/prometheus.yml"
    listen = _flag(prom_cmd, "--web.listen-address") or ":9090"
    prom_port = int(listen.rsplit(":", 1)[1])

    mounts = _mounts(graf)
    provisioning = DOCKER / "grafana" / "provisioning"
    assert next(dst for dst, src in mounts.items() if src == provisioning) == (
        "/etc/grafana/provisioning"
    )
    dash_dir = next(dst for dst, src in mounts.items() if src == DASHBOARD.parent)
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["options"]["path"] == dash_dir

    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == f"http://prometheus:{prom_port}"
    dash = json.loads(DASHBOARD.read_text())
    uids = {
        t.get("datasource", p.get("datasource", {})).get("uid")
        for p in dash["panels"]
        for t in p.get("targets", [{}])
        if p["type"] != "row"
    }
    assert uids == {ds["uid"]}, "every panel must query the provisioned datasource"
    assert graf["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for svc in (prom, graf):
        assert svc["healthcheck"]["test"][0] == "CMD"
    ports = [str(p) for p in graf.get("ports", [])]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports), ports
    assert not prom.get("ports"), "Prometheus stays on the compose network"


@pytest.mark.timeout(90)
def test_every_dashboard_query_runs_on_a_live_prometheus(tmp_path):
    """Our prometheus.yml (targets swapped for loopback processes) scrapes a real router and
    engine; every dashboard query must parse and evaluate, and router series carry
    ``engine`` (the relabelling works)."""
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s")
    with engines(tmp_path, 1, "--profile", "swa-hybrid", "--time-scale", "20") as engs:
        router = start_router(tmp_path, engs)
        port = free_port()
        jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
        jobs[ROUTER_JOB]["static_configs"] = [{"targets": [f"127.0.0.1:{router.port}"]}]
        jobs[ENGINE_JOB]["static_configs"] = [{"targets": [f"127.0.0.1:{engs[0].port}"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        cmd = [shutil.which("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}"]
        cmd += [f"--storage.tsdb.path={tmp_path / 'data'}"]
        cmd += [f"--web.listen-address=127.0.0.1:{port}"]
        log = (tmp_path / "prometheus.log").open("wb")
        prom = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{port}/api/v1/query"
        try:
            for _ in range(3):
                httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi " * 50}, timeout=30)

            def query(q: str) -> dict:
                r = httpx.get(api, params={"query": q}, timeout=5)
                return r.json()

            deadline = time.monotonic() + 30
            while True:  # both targets scraped, with the traffic
                try:
                    got = query(
                        'sum(kvroute_router_requests_total{engine!=""}) >= 3 '
                        "and on() sum(vllm:request_success_total) >= 3"
                    )
                    if got["data"]["result"]:
                        break
                except (httpx.HTTPError, ValueError):  # not listening, or 503 while starting
                    pass
                assert prom.poll() is None and time.monotonic() < deadline, (
                    "prometheus never scraped"
                )
                time.sleep(0.2)
            failed = {}
            for title, expr in _dashboard_queries():
                if expr.startswith("label_values("):
                    continue
                q = expr.replace("$__rate_interval", "30s").replace("$__range", "5m")
                res = query(q.replace("$router", ".*"))
                if res["status"] != "success":
                    failed[title] = res.get("error")
            assert not failed, failed
        finally:
            prom.terminate()
            prom.wait(10)
            log.close()
            router.stop()
