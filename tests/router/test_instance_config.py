"""``--instance URL=<vLLM's --kv-events-config JSON>``: the router subscribes where vLLM
publishes, binding when vLLM connects (vLLM's bind/connect rule), connecting otherwise."""

from __future__ import annotations

import json

import pytest

from router.fleet.specs import parse_instance


def _cfg(**kw: object) -> str:
    return json.dumps({"enable_kv_cache_events": True, **kw})


def test_wildcard_endpoint_is_reached_at_the_instance_host():
    spec = parse_instance(
        "http://10.1.2.3:8000="
        + _cfg(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", topic="kv")
    )
    assert spec.events == "tcp://10.1.2.3:5557"
    assert spec.replay == "tcp://10.1.2.3:5558"
    assert spec.topic == "kv"
    assert spec.bind is False  # vLLM binds a wildcard: the router connects


def test_concrete_endpoint_means_vllm_connects_so_the_router_binds():
    spec = parse_instance("http://127.0.0.1:8000=" + _cfg(endpoint="tcp://127.0.0.1:6000"))
    assert (spec.events, spec.bind, spec.replay) == ("tcp://127.0.0.1:6000", True, None)


def test_ipc_endpoint_is_bound_by_vllm_and_connected_to_by_the_router():
    spec = parse_instance("http://127.0.0.1:8000=" + _cfg(endpoint="ipc:///tmp/kv.sock"))
    assert (spec.events, spec.bind) == ("ipc:///tmp/kv.sock", False)


def test_vllm_default_endpoint_and_disabled_events():
    spec = parse_instance("http://[::1]:8000=" + _cfg())  # vLLM's default tcp://*:5557
    assert spec.events == "tcp://[::1]:5557"
    off = parse_instance("http://h:8000=" + json.dumps({"enable_kv_cache_events": False}))
    assert off.events is None


@pytest.mark.parametrize(
    "bad",
    ['{"enable_kv_cache_events": true, "endpoint": "http://x"}', '{"endpont": "tcp://*:1"}', "{"],
)
def test_bad_kv_events_config_is_a_clear_error(bad: str):
    with pytest.raises(ValueError):
        parse_instance("http://127.0.0.1:8000=" + bad)


def test_legacy_form_still_parses():
    spec = parse_instance("http://127.0.0.1:8000=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558")
    assert (spec.events, spec.replay, spec.bind) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        None,
    )


def test_declared_models_are_options_with_or_without_an_events_endpoint():
    spec = parse_instance("http://h:8000=tcp://h:5557,model=llama,model=llama-sql")
    assert spec.events == "tcp://h:5557" and spec.models == ("llama", "llama-sql")
    bare = parse_instance("http://h:8000=,model=qwen")
    assert bare.events is None and bare.models == ("qwen",)
    assert parse_instance("http://h:8000").models == ()


def test_dp_ranks_follow_vllms_port_offsets_and_need_events_to_be_told_apart():
    from router.fleet.specs import rank_specs

    spec = parse_instance("http://h:8000=tcp://h:5557,replay=tcp://h:5600,dp=3,model=m")
    ranks = rank_specs(spec)
    assert [r.url for r in ranks] == [f"http://h:8000#dp{i}" for i in range(3)]
    assert [r.events for r in ranks] == ["tcp://h:5557", "tcp://h:5558", "tcp://h:5559"]
    assert [r.replay for r in ranks] == ["tcp://h:5600", "tcp://h:5601", "tcp://h:5602"]
    assert {r.http_url for r in ranks} == {"http://h:8000"} and ranks[2].models == ("m",)
    assert [r.dp_rank for r in ranks] == [0, 1, 2]
    # No events: one target, vLLM balances its ranks.
    assert rank_specs(parse_instance("http://h:8000=,dp=2")) == [
        parse_instance("http://h:8000=,dp=2")
    ]
    # vLLM cannot offset an ipc endpoint per rank; neither can we.
    with pytest.raises(ValueError, match="offset"):
        parse_instance("http://h:8000=ipc:///tmp/kv,dp=2")
    with pytest.raises(ValueError, match="dp must be"):
        parse_instance("http://h:8000=tcp://h:1,dp=0")
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:7000"})
    assert rank_specs(parse_instance(f"http://h:8000={cfg},dp=2"))[1].events == "tcp://h:7001"


def test_each_settings_section_is_exactly_its_components_config():
    """A component is configured by its section of ``RouterSettings`` (flat names such as
    ``admission_timeout_s`` land in it): the admission controller and session affinity take
    the section itself, the health checker its fields, so a new setting in a section must be
    a parameter of its component or building the router fails here."""
    import httpx

    from router.config import RouterSettings
    from router.fleet.admission import AdmissionConfig
    from router.fleet.affinity import AffinityConfig
    from router.fleet.instances import InstanceRegistry

    s = RouterSettings(admission_timeout_s=3.0, session_header="x-s", health_failures=4)
    assert isinstance(s.admission, AdmissionConfig) and isinstance(s.session, AffinityConfig)
    assert s.admission.timeout_s == 3.0 and s.admission.queue_size == 1024
    assert s.session.header == "x-s"
    registry = InstanceRegistry(httpx.AsyncClient(), **s.health.model_dump())
    assert (registry.failures, registry.interval_s) == (4, 2.0)
