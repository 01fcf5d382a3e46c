"""Commands pass their flags on to the settings they build by name (kvroute_cli.options):
every flag must arrive, renamed ones included, and a wrong name must fail loudly."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvroute_cli.main import app
from kvroute_cli.options import field_names, fields_from
from router.config import RouterSettings


@dataclasses.dataclass
class _Conf:
    a: int = 1
    b: str = "x"
    derived: int = dataclasses.field(default=0, init=False)


def test_fields_from_takes_matching_names_and_given_values_only():
    scope = {"a": 5, "b": "y", "unrelated": 3, "derived": 9}
    assert field_names(_Conf) == ("a", "b")
    assert fields_from(_Conf, scope) == {"a": 5, "b": "y"}
    assert fields_from(_Conf, scope, b="z") == {"a": 5, "b": "z"}
    assert "host" in field_names(RouterSettings)  # pydantic models

    def fn(x: int, *, y: int = 0) -> None: ...

    assert fields_from(fn, {"x": 1, "z": 2}) == {"x": 1}
    with pytest.raises(TypeError, match="nope"):
        fields_from(_Conf, scope, nope=1)


def test_engine_flags_reach_engine_settings(monkeypatch):
    import engine_adapter.sim.server as server

    seen = []
    monkeypatch.setattr(server, "serve", lambda settings, log_level: seen.append(settings))
    args = ["engine", "--name", "e1", "--lora-modules", "sql=/tmp/sql", "--gpu-blocks", "77",
            "--prefix-caching-hash-algo", "xxhash", "--prefill-tokens-per-s", "500"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (s,) = seen
    # The adapter's NAME must not replace the engine's own --name.
    assert (s.name, s.lora_modules, s.gpu_blocks) == ("e1", {"sql": "/tmp/sql"}, 77)
    assert s.hash_algo == "xxhash" and s.timing.prefill_s_per_token == pytest.approx(1 / 500)


def test_router_flags_reach_router_settings_and_bad_ones_are_refused(monkeypatch):
    import router.http.server as server

    seen = []
    monkeypatch.setattr(server, "serve", seen.append)
    args = ["router", "--instance", "http://127.0.0.1:9", "--policy", "round_robin",
            "--admission-timeout", "3", "--health-interval", "2",
            "--session-max-extra-ttft", "0.2"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (s,) = seen
    assert s.instances == ["http://127.0.0.1:9"] and s.policy == "round_robin"
    assert (s.admission.timeout_s, s.health.interval_s, s.session.max_extra_ttft_s) == (
        3.0,
        2.0,
        0.2,
    )
    bad = CliRunner().invoke(app, ["router", "--admission-max-kv-usage", "2"])
    assert bad.exit_code == 2 and "admission-max-kv-usage" in bad.output


def test_top_level_help_lists_the_generated_commands_without_their_settings_models():
    """``kvroute --help`` shows ``router``/``engine``/``up`` from their docs; their settings
    models (pydantic, router.config, engine settings, the demo's) load only when one runs."""
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvroute_cli.main import app\n"
        "r = CliRunner().invoke(app, ['--help'], env={'COLUMNS': '200'})\n"
        "assert r.exit_code == 0, r.output\n"
        "assert all(f' {c} ' in r.output for c in ('router', 'engine', 'up')), r.output\n"
        "heavy = ('pydantic', 'router.config', 'engine_adapter.sim.settings', 'stack')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    ok = CliRunner().invoke(app, ["engine", "--help"], env={"COLUMNS": "200"})
    assert ok.exit_code == 0 and "--gpu-blocks" in ok.output  # built when asked for
