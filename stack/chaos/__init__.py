"""``kvroute bench chaos``: inject faults into a live deployment and count what they cost.

Every scenario runs real processes on loopback (engines, a router, Redis) or the real
in-process event path, injects one kind of fault and returns a typed result: the raw
observations the reliability tests (``tests/reliability``) assert on, and the row of
figures the table prints:

* ``engine_kill``: SIGKILL an engine while streams run through the router. Requests that
  had no first byte must be retried elsewhere (0 lost); streams already started must end
  with an SSE error chunk; the dead engine's residency must be dropped and, once it is back
  (sequence from 0), rebuilt from its new events only.
* ``dropped_events``: a ZMQ proxy between an engine's publisher and the router's ingest
  drops a window of batches; the subscriber must detect the gap and replay it (index ==
  the engine's true residency), or -- when the replay buffer lost them -- clear and rebuild
  the instance (index a subset of the truth: never stale).
* ``redis_outage``: kill Redis under load, restart it empty: 0 failed requests, routing
  on load only meanwhile, then cache-aware again with the history rebuilt from replay.
* ``fuzz_events`` / ``fuzz_http``: random and mutated msgpack payloads through the real
  subscriber and ingest; random and mutated HTTP bodies and headers into router and engine.
* ``stream_load``: many concurrent streams through the router, each stream's text checked
  against the engine's deterministic filler; the router's RSS before and after.

The result types live in ``results`` (one dataclass per scenario, each field commented;
import them from there);
the runner prints each result's ``row()`` and writes its ``asdict`` into ``chaos.json``.

``run(out, ...)`` runs them all, prints the table and writes ``out/chaos.json``.

Modules: ``procs`` (child processes), ``client`` (requests, answers, probes), one module
per scenario (``faults_engine``, ``faults_events``, ``faults_index``, ``fuzz_events``,
``fuzz_http``, ``load``), ``results`` (what they return) and ``runner`` (the whole run and
its table).
"""

from stack.chaos.client import StreamOutcome, expected_text, scrape
from stack.chaos.client import index_tokens as index_tokens
from stack.chaos.client import metrics_text as metrics_text
from stack.chaos.client import new_client as new_client
from stack.chaos.client import route_view as route_view
from stack.chaos.client import send_completion as send_completion
from stack.chaos.client import wait_for as wait_for
from stack.chaos.faults_engine import engine_kill
from stack.chaos.faults_events import DropProxy as DropProxy
from stack.chaos.faults_events import dropped_events
from stack.chaos.faults_index import redis_outage
from stack.chaos.fuzz_events import fuzz_events
from stack.chaos.fuzz_events import hypothesis_payloads as hypothesis_payloads
from stack.chaos.fuzz_events import random_payloads as random_payloads
from stack.chaos.fuzz_http import fuzz_http, oversize_checks
from stack.chaos.fuzz_http import http_cases as http_cases
from stack.chaos.fuzz_http import judge_http as judge_http
from stack.chaos.load import stream_load
from stack.chaos.runner import run
from stack.procs import KVROUTE as KVROUTE
from stack.procs import LOOPBACK as LOOPBACK
from stack.procs import REPO as REPO
from stack.procs import Fleet, rss_mb
from stack.procs import Proc as Proc
from stack.procs import free_port as free_port
from stack.procs import start_engines as start_engines
from stack.procs import wait_http as wait_http

__all__ = [
    "Fleet",
    "StreamOutcome",
    "dropped_events",
    "engine_kill",
    "expected_text",
    "fuzz_events",
    "fuzz_http",
    "oversize_checks",
    "redis_outage",
    "rss_mb",
    "run",
    "scrape",
    "stream_load",
]
