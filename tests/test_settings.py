"""One name per setting, written once: the router's settings reach its components, the same
name works as a flag, an environment variable and a YAML key (flat or nested), flags beat
the environment which beats the file, and the generated help shows defaults and bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from kvroute_cli.main import app
from kvroute_cli.options import load_layered, settings_flags
from router.config import CostSettings, RouterSettings, Section, nest, sections


def test_flat_and_nested_names_are_the_same_setting():
    flat = RouterSettings(admission_max_waiting=8, cost_stick_margin=0.5, health_failures=3)
    nested = RouterSettings(
        admission={"max_waiting": 8}, cost={"stick_margin": 0.5}, health={"failures": 3}
    )
    assert flat == nested
    assert flat.admission.max_waiting == 8 and flat.admission.queue_size == 1024
    assert flat.cost.stick_margin == 0.5 and flat.cost.load_exponent == 1.5
    # Names the rates and the upstream client had before they moved into their sections.
    moved = RouterSettings(prefill_s_per_token=2e-4, max_retries=0, request_timeout_s=9)
    assert moved.cost.prefill_s_per_token == 2e-4
    assert (moved.upstream.max_retries, moved.upstream.request_timeout_s) == (0, 9.0)


def test_bounds_and_unknown_names_are_refused():
    with pytest.raises(ValidationError, match="max_kv_usage"):
        RouterSettings(admission_max_kv_usage=2)
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        CostSettings(continuation_fraction=1.5)
    with pytest.raises(ValidationError, match="nope"):
        RouterSettings(admission_nope=1)
    with pytest.raises(ValidationError, match="policy"):
        RouterSettings(policy="fastest")


def test_flags_beat_environment_beat_yaml(tmp_path, monkeypatch):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        "admission:\n  max_waiting: 1\n  queue_size: 7\nhealth_failures: 5\n"
        "cost_load_exponent: 2.0\nport: 9001\n"
    )
    monkeypatch.setenv("KVROUTE_ADMISSION_MAX_WAITING", "2")
    monkeypatch.setenv("KVROUTE_COST_LOAD_EXPONENT", "1.25")
    monkeypatch.setenv("KVROUTE_PORT", "9002")
    s = load_layered(
        RouterSettings, {"port": 9003, "health": {"failures": None}}, cfg,
        env_prefix="KVROUTE_", nest=lambda data: nest(RouterSettings, data),
    )  # fmt: skip
    assert s.port == 9003  # flag
    assert s.admission.max_waiting == 2 and s.cost.load_exponent == 1.25  # environment
    assert s.admission.queue_size == 7 and s.health.failures == 5  # file, section kept whole
    assert s.health.interval_s == 2.0  # default


def test_engine_and_up_take_the_same_layers_as_the_router(tmp_path, monkeypatch):
    """``kvroute engine`` and ``kvroute up``: flags > KVROUTE_ENGINE_* / KVROUTE_UP_* >
    --config YAML, every layer by field name."""
    import engine_adapter.sim.server as server
    import stack.demo as demo

    cfg = tmp_path / "engine.yaml"
    cfg.write_text("gpu_blocks: 100\nmax_num_seqs: 5\nlora_modules: {a: /a}\nport: 1\n")
    monkeypatch.setenv("KVROUTE_ENGINE_GPU_BLOCKS", "200")
    monkeypatch.setenv("KVROUTE_ENGINE_PORT", "2")
    monkeypatch.setenv("KVROUTE_PORT", "9")  # the router's: not the engine's
    seen = []
    monkeypatch.setattr(server, "serve", lambda settings, log_level: seen.append(settings))
    args = ["engine", "--config", str(cfg), "--port", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (e,) = seen
    assert (e.port, e.gpu_blocks, e.max_num_seqs, e.lora_modules) == (3, 200, 5, {"a": "/a"})
    monkeypatch.setenv("KVROUTE_ENGINE_GPU_BLOCKS", "0")  # a bound, as a flag's
    bad = CliRunner().invoke(app, ["engine", "--config", str(cfg)])
    assert bad.exit_code == 2 and "gpu_blocks" in bad.output

    up_cfg = tmp_path / "up.yaml"
    up_cfg.write_text("turns: 2\nconversations: 3\npolicies: [cost, round_robin]\n")
    monkeypatch.setenv("KVROUTE_UP_CONVERSATIONS", "4")
    runs = []

    def run_up(cfg, **kwargs):  # the settings it was given; no stack started
        runs.append(cfg)
        raise demo.DemoError("stopped by the test")

    monkeypatch.setattr(demo, "run_up", run_up)
    result = CliRunner().invoke(app, ["up", "--config", str(up_cfg), "--max-tokens", "7"])
    assert result.exit_code == 1 and "stopped by the test" in result.output
    (u,) = runs
    assert (u.turns, u.conversations, u.max_tokens) == (2, 4, 7)
    assert u.policies == ("cost", "round_robin")


def test_every_component_setting_has_a_flag_named_after_it():
    names = {decl for f in settings_flags(RouterSettings) for decl in f.option.param_decls}
    for section, model in sections(RouterSettings).items():
        assert issubclass(model, Section)
        for field in model.model_fields:
            flag = f"--{section}-{field}".replace("_", "-")
            assert flag in names or f"{flag}/--no-{flag[2:]}" in names, flag


def test_router_help_shows_defaults_and_bounds():
    out = CliRunner().invoke(app, ["router", "--help"], env={"COLUMNS": "200"}).output
    assert "--cost-load-exponent" in out and "default 1.5" in out
    assert "--admission-max-kv-usage" in out and "<= 1" in out
    assert "--health-interval" in out and "default 2.0" in out


def test_router_flags_reach_the_cost_policy(monkeypatch):
    """A cost knob given as a flag is the value the built policy ranks with."""
    import router.http.server as server
    from router.state import RouterState

    seen = []
    monkeypatch.setattr(server, "serve", seen.append)
    args = ["router", "--cost-stick-margin", "0.75", "--cost-prefill-s-per-token", "0.001",
            "--speculative-ttl", "0.5", "--eviction-window-s", "0"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (settings,) = seen
    state = RouterState(settings)
    assert state.policy.defaults.stick_margin == 0.75
    assert state.policy.defaults.prefill_s_per_token == 0.001
    assert state.prediction.store.ttl_s == 0.5 and state.prediction.evictions is None
    refused = CliRunner().invoke(app, ["router", "--cost-fit-decay", "0"])
    assert refused.exit_code == 2 and "cost-fit-decay" in refused.output
