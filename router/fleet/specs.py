"""The ``--instance`` grammar: an engine instance as the router's subscriber sees it.

``URL[=EVENTS_ENDPOINT[,replay=ENDPOINT][,topic=T][,model=NAME]...[,dp=N]]``, or
``URL=<vLLM's --kv-events-config JSON>`` as the engine was started with it (the router
takes the side of each socket opposite to vLLM's, by ``events.publisher.is_bind_endpoint``).
A data-parallel engine becomes one target per rank (``rank_specs``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from urllib.parse import urlparse

from events.publisher import is_bind_endpoint

__all__ = [
    "CpuChunk",
    "InstanceSpec",
    "from_kv_events_config",
    "from_kv_transfer_config",
    "parse_instance",
    "rank_specs",
]


@dataclass(frozen=True, slots=True)
class CpuChunk:
    """An instance's CPU offload chunk as its ``--kv-transfer-config`` sets it: vLLM's
    ``kv_connector_extra_config`` takes ``blocks_per_chunk`` (GPU blocks per chunk) or
    ``block_size`` (tokens per chunk), one of them; neither means one block per chunk
    (``offloading/config.py``). Exactly one field is set."""

    blocks: int | None = None
    tokens: int | None = None


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """``URL[=EVENTS_ENDPOINT[,replay=ENDPOINT][,topic=T][,model=NAME]...[,dp=N]]`` or ``URL=<vLLM's
    --kv-events-config JSON>``, as the router's subscriber sees it.

    ``bind``: whether the router's SUB socket binds ``events`` (the engine connects to
    it) or connects; None keeps the subscriber's rule (bind a wildcard endpoint).
    """

    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""
    bind: bool | None = None
    models: tuple[str, ...] = ()  # declared served models: override its /v1/models
    # ``dp=N``: the engine runs N data-parallel ranks; each becomes its own target
    # (``rank_specs``), named ``URL#dpR`` and reached with vLLM's X-data-parallel-rank.
    dp_size: int = 1
    dp_rank: int | None = None
    # A bare ``URL``: its event endpoints and data-parallel ranks are read from vLLM's
    # ``GET /kv_event_sources`` (``router.fleet.discovery``); ``URL=`` means no events.
    discover: bool = False
    # ``kv_transfer_config=<JSON>``: the CPU chunk of the instance's OffloadingConnector
    # (None: not given, the router learns it from the events).
    cpu_chunk: CpuChunk | None = None

    @property
    def http_url(self) -> str:
        """Where the engine answers HTTP (a rank target's name without ``#dpR``)."""
        return self.url.partition("#")[0]


def rank_specs(spec: InstanceSpec) -> list[InstanceSpec]:
    """One target per data-parallel rank: vLLM's rank r publishes on the endpoint and
    replay endpoint offset by r (``offset_endpoint_port``: tcp port + r, inproc ``_dpR``).
    Without events the ranks cannot be told apart: the instance stays one target and
    vLLM balances its own ranks."""
    if spec.dp_size <= 1 or spec.events is None:
        return [spec]
    from events.publisher import offset_endpoint_port

    return [
        InstanceSpec(
            f"{spec.url}#dp{r}",
            offset_endpoint_port(spec.events, r),
            offset_endpoint_port(spec.replay, r),
            spec.topic,
            spec.bind,
            spec.models,
            dp_rank=r,
            cpu_chunk=spec.cpu_chunk,
        )
        for r in range(spec.dp_size)
    ]


def _check_endpoint(ep: str | None) -> None:
    if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"ZMQ endpoint must be tcp://, ipc:// or inproc://, got {ep!r}")


def _towards(endpoint: str, host: str) -> str:
    """Where to reach an endpoint the engine binds: its wildcard host becomes ``host``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    _, _, port = endpoint.rpartition(":")
    bound = endpoint[len("tcp://") : -len(port) - 1]
    if bound in ("*", "[::]", "::", "0.0.0.0"):
        bound = f"[{host}]" if ":" in host else host
    return f"tcp://{bound}:{port}"


def from_kv_events_config(url: str, text: str) -> InstanceSpec:
    """An instance from the exact ``--kv-events-config`` JSON its vLLM was started with.

    The engine binds ``tcp://*:P`` (or ipc): the router connects to the instance's host;
    an engine given a concrete address connects to it, so the router binds there. The
    replay endpoint is always bound by the engine. Data-parallel ranks other than 0 are
    not followed here.
    """
    from events.config import KVEventsConfig

    cfg = KVEventsConfig.from_json(text)
    if not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return InstanceSpec(url)
    host = urlparse(url).hostname or "127.0.0.1"
    binds = is_bind_endpoint(cfg.endpoint)
    events = _towards(cfg.endpoint, host) if binds else cfg.endpoint
    replay = _towards(cfg.replay_endpoint, host) if cfg.replay_endpoint else None
    for ep in (events, replay):
        _check_endpoint(ep)
    return InstanceSpec(url, events, replay, cfg.topic, bind=not binds)


def from_kv_transfer_config(text: str) -> CpuChunk | None:
    """The CPU chunk set by the exact ``--kv-transfer-config`` JSON an instance's vLLM was
    started with; None when it runs no ``OffloadingConnector`` (no CPU tier to read).
    Raises ValueError as vLLM would refuse the same settings."""
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"bad --kv-transfer-config JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    if cfg.get("kv_connector") != "OffloadingConnector":
        return None
    extra = cfg.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    blocks, tokens = extra.get("blocks_per_chunk"), extra.get("block_size")
    if blocks is not None and tokens is not None:
        raise ValueError("specify only one of 'block_size' or 'blocks_per_chunk'")
    for key, value in (("blocks_per_chunk", blocks), ("block_size", tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        if value is not None and value <= 0:
            raise ValueError(f"{key} must be greater than 0, got {value}")
    if tokens is not None:
        return CpuChunk(tokens=tokens)
    return CpuChunk(blocks=blocks if blocks is not None else 1)


def _split_options(text: str, whole: str) -> list[str]:
    """``,key=value`` options after an instance's events part; a value that starts with
    ``{`` is a JSON object and may hold commas. Returns ``["", "key=value", ...]``."""
    parts = [""]
    i = 0
    while i < len(text):
        if text[i] != ",":
            raise ValueError(f"expected ',option=value' in {whole!r}")
        key, eq, _ = text[i + 1 :].partition("=")
        start = i + 1 + len(key) + len(eq)
        if eq and start < len(text) and text[start] == "{" and "," not in key:
            try:
                _, end = json.JSONDecoder().raw_decode(text, start)
            except ValueError as exc:
                raise ValueError(f"bad JSON for {key!r} in {whole!r}: {exc}") from None
        else:
            end = text.find(",", i + 1)
            end = len(text) if end < 0 else end
        parts.append(text[i + 1 : end])
        i = end
    return parts


def parse_instance(text: str) -> InstanceSpec:
    """Parse one ``--instance`` value; raises ValueError with the reason.

    ``URL`` alone (endpoints and ranks discovered from the instance),
    ``URL=EVENTS[,replay=EP][,topic=T][,model=NAME]...[,dp=N]``, or ``URL=<vLLM's
    --kv-events-config JSON>`` optionally followed by ``,model=NAME`` / ``,dp=N``; either
    explicit form may add ``,kv_transfer_config=<vLLM's --kv-transfer-config JSON>`` (the
    CPU offload chunk size, which placeholder CPU events do not carry).
    """
    url, eq, rest = text.strip().partition("=")
    url = url.rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"instance URL must be http(s)://host:port, got {url!r}")
    if not eq:
        return InstanceSpec(url, discover=True)
    rest = rest.strip()
    if rest.startswith("{"):
        try:
            _, end = json.JSONDecoder().raw_decode(rest)
        except ValueError as exc:
            raise ValueError(f"bad --kv-events-config JSON in {text!r}: {exc}") from None
        base = from_kv_events_config(url, rest[:end])
        parts = _split_options(rest[end:], text)
        return _with_options(base, parts, text, allowed=("model", "dp", "kv_transfer_config"))
    events, _, options = rest.partition(",")
    parts = _split_options("," + options, text) if options else []
    _check_endpoint(events or None)
    return _with_options(InstanceSpec(url, events or None), parts or [events], text)


def _with_options(
    spec: InstanceSpec,
    parts: list[str],
    text: str,
    allowed: tuple[str, ...] = ("replay", "topic", "model", "dp", "kv_transfer_config"),
) -> InstanceSpec:
    """``spec`` with the ``key=value`` options of ``parts[1:]``."""
    replay, topic, models, dp = spec.replay, spec.topic, list(spec.models), spec.dp_size
    chunk = spec.cpu_chunk
    for part in parts[1:]:
        key, _, value = part.partition("=")
        if key not in allowed:
            raise ValueError(f"unknown instance option {key!r} in {text!r}")
        if key == "replay":
            replay = value or None
            _check_endpoint(replay)
        elif key == "topic":
            topic = value
        elif key == "model" and value:
            models.append(value)
        elif key == "dp":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"dp must be a positive rank count, got {value!r} in {text!r}")
            dp = int(value)
        elif key == "kv_transfer_config":
            try:
                chunk = from_kv_transfer_config(value)
            except ValueError as exc:
                raise ValueError(f"{exc} in {text!r}") from None
    spec = replace(
        spec, replay=replay, topic=topic, models=tuple(models), dp_size=dp, cpu_chunk=chunk
    )
    if dp > 1:
        rank_specs(spec)  # an endpoint that cannot be offset per rank fails here
    return spec
