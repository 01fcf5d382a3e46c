"""``ours:POLICY*N`` in the benchmarks: N workers on one port, on a Redis index."""

from __future__ import annotations

import pytest

from bench.replay.config import ReplayConfig, parse_router
from bench.replay.procs import router_command


def test_ours_with_workers_runs_them_on_the_index_given():
    assert parse_router("ours:cost*2") == ("ours", "cost*2")
    cmd = router_command("ours", "cost*2", 8080, [], ReplayConfig(), "redis://127.0.0.1:1/0")
    assert cmd[cmd.index("--policy") + 1] == "cost"
    assert cmd[cmd.index("--workers") + 1] == "2"
    assert cmd[cmd.index("--index") + 1] == "redis://127.0.0.1:1/0"
    assert "--workers" not in router_command("ours", "cost", 8080, [], ReplayConfig())


@pytest.mark.parametrize("spec", ["ours:cost*0", "ours:cost*x", "ours:nope*2"])
def test_bad_worker_specs_are_refused(spec):
    with pytest.raises(ValueError):
        parse_router(spec)


def test_ours_at_a_checkout_runs_that_checkouts_router(tmp_path):
    """``ours:POLICY@CHECKOUT``: another checkout's own kvroute (a before/after run)."""
    with pytest.raises(ValueError, match=r"setup\.sh"):
        parse_router(f"ours:cost@{tmp_path}")  # no .venv there
    exe = tmp_path / ".venv" / "bin" / "kvroute"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    assert parse_router(f"ours:cost@{tmp_path}") == ("ours", f"cost@{tmp_path}")
    cmd = router_command("ours", f"cost@{tmp_path}", 8080, [], ReplayConfig())
    assert cmd[0] == str(exe) and cmd[cmd.index("--policy") + 1] == "cost"
    assert router_command("ours", "cost", 8080, [], ReplayConfig())[0] != str(exe)
