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

from stack.demo.config import MODEL as MODEL
from stack.demo.config import DemoConfig, DemoError, RequestRecord
from stack.demo.config import Observer as Observer
from stack.demo.processes import KVROUTE as KVROUTE
from stack.demo.summary import prediction_accuracy_from_metrics as prediction_accuracy_from_metrics
from stack.demo.summary import summarize
from stack.demo.up import run_up
from stack.demo.workload import Workload as Workload
from stack.demo.workload import run_workload as run_workload

__all__ = [
    "DemoConfig",
    "DemoError",
    "RequestRecord",
    "run_up",
    "summarize",
]
