"""Random and mutated HTTP bodies and headers into a real router and a real engine: only
4xx (or 502/503/504) JSON errors, no hang, no crash, healthy afterwards; oversized bodies
refused with 413 before they are read whole."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stack.chaos import fuzz_http, http_cases, judge_http, oversize_checks

CASES = 300


async def test_router_answers_garbage_bodies_and_headers_with_json_errors_only(edge):
    r = await fuzz_http(edge.router.url, http_cases(CASES, seed=11))
    assert r.problems == [], "\n".join(r.problems[:20])
    assert r.healthy_after
    assert r.statuses.get(400, 0) > CASES // 3 and r.statuses.get(200, 0) > 0, r


async def test_engine_answers_garbage_bodies_and_headers_with_json_errors_only(edge):
    r = await fuzz_http(edge.engine.url, http_cases(CASES, seed=12))
    assert r.problems == [], "\n".join(r.problems[:20])
    assert r.healthy_after
    assert r.statuses.get(400, 0) > CASES // 3 and r.statuses.get(200, 0) > 0, r


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["prompt", "messages", "max_tokens", "stream", "role", "content"])
            | st.text(max_size=6),
            inner,
            max_size=5,
        )
    ),
    max_leaves=12,
)
_body = _json | st.fixed_dictionaries(
    {"prompt": _json}, optional={"max_tokens": _json, "stream": _json, "stream_options": _json}
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_body, chat=st.booleans())
def test_any_json_body_gets_a_well_formed_answer_from_the_router(edge, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body).encode()
    r = httpx.post(edge.router.url + path, content=raw, timeout=30)
    assert judge_http(r.status_code, r.headers.get("content-type", ""), r.content) is None


def test_oversized_bodies_are_refused_before_being_read_whole(edge):
    for proc, limit in ((edge.router, edge.router_body_limit), (edge.engine, 16 << 20)):
        out = oversize_checks(proc.port, "/v1/completions", limit)
        announced, chunked = out.announced, out.chunked
        # 10 GB announced, 1 KiB sent: refused at once, from the header.
        assert announced.status == 413, (proc.name, out)
        assert announced.body["error"]["code"] == 413
        assert announced.s < 5
        # An endless chunked body: refused once the limit is passed, not read to the end.
        assert chunked.status == 413, (proc.name, out)
        assert chunked.body["error"]["code"] == 413
        assert limit < chunked.sent_bytes < chunked.offered_bytes, (proc.name, out)
        assert httpx.get(f"{proc.url}/health").status_code == 200
