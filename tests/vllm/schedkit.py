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
from pathlib import Path
from typing import Any

from harness import REPO

from engine_adapter.vllm_cpu import server_env

__all__ = ["SCHED", "offload_rows", "run_driver", "vllm033_sources"]

SCHED = Path(__file__).resolve().parent / "sched"

_spec = importlib.util.spec_from_file_location("kvroute_sched_rows", SCHED / "rows.py")
assert _spec is not None and _spec.loader is not None
_rows = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rows)
offload_rows = _rows.offload_rows


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
