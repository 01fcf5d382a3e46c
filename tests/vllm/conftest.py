"""Fixtures for the real-vLLM suite: the vLLM venv, the tiny models, servers, recorders.

Nothing here skips when vLLM is missing: the venv is installed on first use (minutes), so a
green run always means vLLM really ran. Servers are stopped at teardown; their logs stay
under the test's tmp dir (the path is logged) for post-mortems.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schedkit
from harness import MODEL_NAMES, EventRecorder, VllmServer, ensure_models
from harness import vllm_python as find_vllm_python
from schedkit import vllm033_sources

logger = logging.getLogger(__name__)


class ServerFactory:
    """``factory("gemma3", kv_events_config=..., num_gpu_blocks=240)`` -> a ready server.

    ``model`` is one of ``MODEL_NAMES`` or a model dir; other keywords go to
    ``VllmServer.start``. Every server started here is stopped by ``stop_all``.
    """

    def __init__(self, python: Path, models: Path, log_dir: Path) -> None:
        self.python = python
        self.models = models
        self.log_dir = log_dir
        self.servers: list[VllmServer] = []

    def model_dir(self, model: str | Path) -> Path:
        return self.models / model if model in MODEL_NAMES else Path(model)

    def __call__(
        self, model: str | Path = "llama", *, name: str | None = None, **start: Any
    ) -> VllmServer:
        name = name or f"{Path(model).name}-{len(self.servers)}"
        server = VllmServer(self.python, self.log_dir, name=name)
        self.servers.append(server)
        logger.info("starting %s; log %s", name, server.log_path)
        server.start(self.model_dir(model), **start)
        return server

    def stop_all(self) -> None:
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's python (installs the venv on first use)."""
    return find_vllm_python()


@pytest.fixture(scope="session")
def vllm_models(vllm_python: Path) -> Path:
    """Dir with ``gemma3``, ``qwen3next``, ``llama`` (made once per make_models.py)."""
    return ensure_models(python=vllm_python)


@pytest.fixture(scope="session")
def vllm033_src() -> Path:
    """0.33's Python sources, for vLLM's scheduler driven in process (``schedkit``)."""
    return vllm033_sources()


@pytest.fixture(scope="session")
def driver_runs(
    vllm_python: Path, vllm_models: Path, request: pytest.FixtureRequest
) -> dict[tuple[str, str, str], Any]:
    """vLLM's in-process results for every collected in-process suite (``schedkit``)."""
    return schedkit.driver_runs(
        vllm_python, vllm_models, lambda: request.getfixturevalue("vllm033_src")
    )


@pytest.fixture
def vllm_server(vllm_python: Path, vllm_models: Path, tmp_path: Path) -> Iterator[ServerFactory]:
    """Per-test server factory; all its servers are stopped at teardown."""
    factory = ServerFactory(vllm_python, vllm_models, tmp_path / "vllm-logs")
    yield factory
    factory.stop_all()


@pytest.fixture(scope="module")
def vllm_server_module(
    vllm_python: Path, vllm_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerFactory]:
    """Module-wide factory: for servers shared by several tests (start-up costs ~30 s)."""
    factory = ServerFactory(vllm_python, vllm_models, tmp_path_factory.mktemp("vllm-logs"))
    yield factory
    factory.stop_all()


@pytest.fixture
def event_recorder() -> Iterator[Any]:
    """``event_recorder(kv_events_config)`` -> a started EventRecorder, closed at teardown."""
    recorders: list[EventRecorder] = []

    def make(kv_events_config: dict[str, Any]) -> EventRecorder:
        rec = EventRecorder.for_config(kv_events_config).start()
        recorders.append(rec)
        return rec

    yield make
    for rec in recorders:
        rec.close()
