"""Real vLLM on this machine: PyPI's CPU build in its own venv, serving tiny hybrid models.

vLLM is the oracle for everything kvroute claims about vLLM (the conformance suite in
``tests/vllm``) and can back the demo (``kvroute up --engine vllm``). It lives in its own
venv (``install.sh``; its pins differ from ours and the project never depends on it). The
models are made locally with random weights (``make_models.py``, run by that venv's
python): nothing is downloaded. Their byte-level tokenizer gives token id == UTF-8 byte,
and their chat template is ``events.tokenizer.apply_chat_template``'s, so the router's
default tokenizer reproduces vLLM's token ids exactly.

Stdlib only: importing this module never imports torch or vLLM.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "INSTALL_SCRIPT",
    "MAKE_LORA",
    "MAKE_MODELS",
    "MODEL_NAMES",
    "OFFLOAD_SPEC_MODULE",
    "OFFLOAD_SPEC_NAME",
    "CpuOffload",
    "ensure_models",
    "models_hash",
    "offline_env",
    "server_argv",
    "server_env",
    "vllm_python",
]

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
INSTALL_SCRIPT = HERE / "install.sh"
MAKE_MODELS = HERE / "make_models.py"
MAKE_LORA = HERE / "make_lora.py"
MODEL_NAMES = ("gemma3", "qwen3next", "llama")
# The out-of-tree offloading spec (offload_spec.py), imported by vLLM from this directory.
OFFLOAD_SPEC_MODULE = "offload_spec"
OFFLOAD_SPEC_NAME = "KvrouteHostOffloadingSpec"


@dataclass(frozen=True, slots=True)
class CpuOffload:
    """vLLM's CPU offload tier (``OffloadingConnector``) for a CPU-build server.

    Field names and defaults are vLLM's ``kv_connector_extra_config`` keys:
    ``cpu_bytes_to_use`` (vLLM divides it into ``num_chunks`` of ``blocks_per_chunk`` GPU
    blocks, each rounded up to the alignment), ``blocks_per_chunk`` 1, ``eviction_policy``
    ``"lru"`` (or ``"arc"``), ``self_describing_kv_events`` False (placeholder events).
    ``hold_polls`` is ours: the host worker reports each copy that many worker polls late,
    so copies look in flight for a few engine steps (0: done within the step);
    ``hold_load_polls`` (ours too; None: ``hold_polls``) holds the loads alone, so a
    request's siblings find its load in flight while its stores land within the step.
    """

    cpu_bytes_to_use: int
    blocks_per_chunk: int = 1
    eviction_policy: str = "lru"
    self_describing_kv_events: bool = False
    hold_polls: int = 0
    hold_load_polls: int | None = None

    def __post_init__(self) -> None:
        if (
            self.cpu_bytes_to_use <= 0
            or self.blocks_per_chunk <= 0
            or self.hold_polls < 0
            or (self.hold_load_polls or 0) < 0
        ):
            raise ValueError(f"invalid CPU offload settings: {self}")
        if self.eviction_policy not in ("lru", "arc"):
            raise ValueError(
                f"eviction_policy must be 'lru' or 'arc', not {self.eviction_policy!r}"
            )

    def kv_transfer_config(self) -> dict[str, Any]:
        """The ``--kv-transfer-config`` a user of a CUDA build would write, with our spec."""
        extra: dict[str, Any] = {
            "spec_name": OFFLOAD_SPEC_NAME,
            "spec_module_path": OFFLOAD_SPEC_MODULE,
            "cpu_bytes_to_use": self.cpu_bytes_to_use,
            "blocks_per_chunk": self.blocks_per_chunk,
            "eviction_policy": self.eviction_policy,
            "self_describing_kv_events": self.self_describing_kv_events,
            "kvroute_hold_polls": self.hold_polls,
        }
        if self.hold_load_polls is not None:
            extra["kvroute_hold_load_polls"] = self.hold_load_polls
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }


@functools.cache
def vllm_python() -> Path:
    """The vLLM venv's python, installing the venv first when needed (minutes, once)."""
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=3600, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{INSTALL_SCRIPT} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    python = Path(proc.stdout.strip().splitlines()[-1])
    log.info("vLLM python %s (%.1f s)", python, time.monotonic() - t0)
    return python


def models_hash() -> str:
    """Cache key of the models: the same hash make_models.py writes into its stamp."""
    return hashlib.sha256(MAKE_MODELS.read_bytes()).hexdigest()[:16]


def ensure_models(cache_dir: Path | None = None, python: Path | None = None) -> Path:
    """Dir holding ``gemma3``, ``qwen3next`` and ``llama``; made once per make_models.py.

    ``cache_dir`` defaults to ``$KVROUTE_VLLM_MODELS`` or ``~/.cache/kvroute/vllm-models``;
    a file lock keeps concurrent callers from writing the same dir at once.
    """
    root = cache_dir or Path(
        os.environ.get("KVROUTE_VLLM_MODELS", Path.home() / ".cache/kvroute/vllm-models")
    )
    digest = models_hash()
    out = Path(root) / digest
    stamp = out / ".stamp"
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.is_file() and stamp.read_text().strip() == digest):
            py = python or vllm_python()
            proc = subprocess.run(
                [str(py), str(MAKE_MODELS), str(out)],
                capture_output=True,
                text=True,
                timeout=600,
                env=offline_env(),
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"make_models.py failed:\n{proc.stderr[-4000:]}")
            log.info("made models in %s", out)
    return out


def offline_env() -> dict[str, str]:
    """Nothing can be fetched here: fail fast instead of waiting on hub timeouts."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1"
    )
    return env


def server_env(*, cpu_offload: bool = False, dev_mode: bool = False) -> dict[str, str]:
    """The environment a vLLM CPU server runs in: 1 GiB of KV space, no core pinning, and
    no PYTHONHASHSEED, so NONE_HASH is vLLM's fixed ``"vllm-none-hash"`` as the router's.

    ``cpu_offload``: this directory goes first on ``PYTHONPATH``, so the API server and the
    engine-core process it spawns both import ``offload_spec``. ``dev_mode``:
    ``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache`` and other dev endpoints).
    """
    env = offline_env()
    env.pop("PYTHONHASHSEED", None)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    if cpu_offload:
        paths = [str(HERE), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def server_argv(
    python: Path,
    model_dir: Path,
    *,
    port: int,
    served_model_name: str,
    kv_events_config: dict[str, Any] | None = None,
    block_size: int | None = None,
    num_gpu_blocks: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int = 2048,
    host: str = "127.0.0.1",
    cpu_offload: CpuOffload | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line of one OpenAI-compatible vLLM server (the ``vllm`` console script
    dies on the distribution name ``vllm-cpu``, so the module is run instead).

    ``cpu_offload`` adds vLLM's ``OffloadingConnector`` with our host-memory spec; run the
    server in ``server_env(cpu_offload=True)`` so its processes can import the spec."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--served-model-name", served_model_name, "--host", host, "--port", str(port)]
    argv += ["--enforce-eager", "--enable-prefix-caching", "--prefix-caching-hash-algo"]
    argv += ["sha256_cbor", "--enable-prompt-tokens-details", "--max-model-len"]
    argv += [str(max_model_len)]
    if kv_events_config is not None:
        argv += ["--kv-events-config", json.dumps(kv_events_config)]
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    if num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    if max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if cpu_offload is not None:
        argv += ["--kv-transfer-config", json.dumps(cpu_offload.kv_transfer_config())]
    return argv + list(extra_args)
