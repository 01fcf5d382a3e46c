"""Running ``sched/driver.py`` (vLLM's own Scheduler in process, canned outputs) from tests.

The driver runs in the vLLM venv; with ``src`` (0.33's unzipped Python sources, from
``sched/install_vllm033.sh``) ahead on ``PYTHONPATH`` it runs 0.33 over the 0.32 venv's
packages. ``offload_rows`` is the driver's own row function (``sched/rows.py``), loaded
here by path: ``sched`` is also a standard-library module name.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pytest
from harness import REPO

from engine_adapter.vllm_cpu import server_env

__all__ = [
    "SCHED",
    "DriverCase",
    "driver_job",
    "driver_runs",
    "offload_rows",
    "register_jobs",
    "release_params",
    "run_driver",
    "vllm033_sources",
]

SCHED = Path(__file__).resolve().parent / "sched"

_spec = importlib.util.spec_from_file_location("kvroute_sched_rows", SCHED / "rows.py")
assert _spec is not None and _spec.loader is not None
_rows = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rows)
offload_rows = _rows.offload_rows


class DriverCase(Protocol):
    """What a driver job takes from a test's case: the driver's layer set, the block size,
    the step budget and the GPU pool."""

    layout: str
    block_size: int
    budget: int
    num_blocks: int


def driver_job(
    model_dir: Path,
    case: DriverCase,
    max_model_len: int,
    requests: list[dict[str, Any]],
    sampled_token: int,
    **extra: Any,
) -> dict[str, Any]:
    """One driver job: ``case`` on ``model_dir``'s config (no weights run), ``requests``
    one at a time (``{"prompt_token_ids", "max_tokens"}`` or ``{"reset": ...}``), every
    step sampling ``sampled_token``. ``extra``: more job keys (``offload``)."""
    return {
        "model_dir": str(model_dir),
        "layout": case.layout,
        "block_size": case.block_size,
        "budget": case.budget,
        "num_blocks": case.num_blocks,
        "max_model_len": max_model_len,
        "sampled_token": sampled_token,
        "requests": requests,
        **extra,
    }


def vllm033_sources() -> Path:
    """0.33's Python sources (the ~340 MB wheel downloaded once and cached)."""
    out = subprocess.run(
        ["bash", str(SCHED / "install_vllm033.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def run_driver(python: Path, payload: dict[str, Any], src: Path | None, timeout: float) -> Any:
    """The driver's answer (its last stdout line, JSON) to one job or ``{"jobs": [...]}``."""
    env = server_env()
    if src is not None:
        env.update(PYTHONPATH=str(src), VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run(
        [str(python), str(SCHED / "driver.py")],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# suite -> its jobs, given the models dir: [(release, case name, job)]. Each in-process
# suite registers when pytest imports it, so one session fixture (``driver_runs``) runs
# every collected suite's jobs in one driver process per release: importing vLLM costs
# more than the jobs.
JobList = list[tuple[str, str, dict[str, Any]]]
_SUITES: dict[str, Callable[[Path], JobList]] = {}


def release_params(runs: list[tuple[str, str]]) -> pytest.MarkDecorator:
    """Parametrises a test over ``(release, case name)`` runs, ids ``release-name``."""
    return pytest.mark.parametrize(("version", "name"), runs, ids=[f"{v}-{n}" for v, n in runs])


def register_jobs(suite: str, jobs: Callable[[Path], JobList]) -> None:
    """Adds ``suite``'s jobs to what ``driver_runs`` runs."""
    _SUITES[suite] = jobs


def driver_runs(
    python: Path, models: Path, sources: Callable[[], Path]
) -> dict[tuple[str, str, str], Any]:
    """vLLM's result for every registered job, keyed ``(suite, release, case name)``: one
    driver process per release; ``sources`` gives 0.33's sources (called only if needed)."""
    jobs = [(suite, *job) for suite, fn in _SUITES.items() for job in fn(models)]
    out: dict[tuple[str, str, str], Any] = {}
    for release in ("0.33", "0.32"):
        mine = [j for j in jobs if j[1] == release]
        if not mine:
            continue
        src = sources() if release == "0.33" else None
        answer = run_driver(python, {"jobs": [j[3] for j in mine]}, src, timeout=1500)
        for (suite, _, name, _), result in zip(mine, answer["results"], strict=True):
            out[(suite, release, name)] = result
    return out
