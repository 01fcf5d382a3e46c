"""``kvroute up``: a whole deployment on loopback, a short multi-turn workload, a summary.

Why a demo runs real processes: the point is to show what a user would get -- N simulated
engines publishing vLLM KV events over ZMQ, the router ingesting them into its index and
routing over HTTP -- not an in-process shortcut. Every child logs to a temp dir (kept and
named when something fails) and is stopped with SIGTERM (then SIGKILL) whatever happens.

Per policy the workload runs against fresh engines (cold caches), so rows are comparable.
Per request we record the instance the router chose (``x-kvroute-instance``), client-side
TTFT, what the engine really reused (``usage.kv_hit``, ``cached_tokens``) and what the router
predicted for it (``x-kvroute-predicted-hit``, else the router's prediction-error
histogram), and reduce that to hit ratio, TTFT p50/p90 and prediction accuracy.

Modules: ``config`` (settings, record, error, hooks), ``workload`` (the chats),
``summary`` (the table row), ``processes`` (children and one round) and ``up`` (``run_up``).
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use, so reading ``stack.demo.config`` (``kvroute up``'s flags are built
# from ``DemoConfig`` whenever ``kvroute`` starts) does not import the processes and HTTP
# client behind the demo.
_WHERE = {
    "MODEL": "config",
    "DemoConfig": "config",
    "DemoError": "config",
    "Observer": "config",
    "RequestRecord": "config",
    "KVROUTE": "processes",
    "prediction_accuracy_from_metrics": "summary",
    "summarize": "summary",
    "run_up": "up",
    "Workload": "workload",
    "run_workload": "workload",
}

__all__ = [
    "DemoConfig",
    "DemoError",
    "RequestRecord",
    "run_up",
    "summarize",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stack.demo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stack.demo.{module}"), name)
