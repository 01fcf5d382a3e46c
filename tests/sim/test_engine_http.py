"""The simulated engine as a real process: HTTP on loopback, KV events over real ZMQ."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest
from kvtest import start_engine

from events.hashing import hash_request_blocks, wire_hash
from events.structs import BlockStored
from events.subscriber import BatchReceived, ZmqEventSubscriber


async def _collect(sub: ZmqEventSubscriber, until, timeout: float = 10.0) -> list:
    """Events from ``sub`` until ``until(events)`` holds (bounded)."""
    events: list = []

    async def run() -> None:
        async for item in sub:
            if isinstance(item, BatchReceived):
                events.extend(item.batch.events)
                if until(events):
                    return

    await asyncio.wait_for(run(), timeout)
    return events


@pytest.fixture(scope="module")
def swa_engine(tmp_path_factory):
    eng = start_engine(
        tmp_path_factory.mktemp("swa"),
        "--profile", "swa-hybrid", "--sliding-window", "64", "--gpu-blocks", "256",
        "--max-model-len", "1024", "--time-scale", "50",
    )  # fmt: skip
    yield eng
    eng.stop()


async def test_repeated_prompt_hits_gpu_and_events_cover_every_group(swa_engine):
    prompt = "The hybrid router keeps window blocks in mind. " * 8
    async with httpx.AsyncClient(base_url=swa_engine.url, timeout=30) as client:
        tokens = (await client.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
        async with ZmqEventSubscriber(swa_engine.events, swa_engine.replay, start_seq=0) as sub:
            first = (await client.post("/v1/completions", json={"prompt": prompt})).json()
            second = (await client.post("/v1/completions", json={"prompt": prompt})).json()
            want = [wire_hash(h) for h in hash_request_blocks(tokens, 16)]
            events = await _collect(
                sub,
                lambda evs: {e.group_idx for e in evs if isinstance(e, BlockStored)} >= {0, 1},
            )
    assert first["usage"]["kv_hit"] == {"gpu_tokens": 0, "cpu_tokens": 0}
    full_hit = ((len(tokens) - 1) // 16) * 16
    assert second["usage"]["kv_hit"]["gpu_tokens"] == full_hit
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == full_hit
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
    by_group = {e.group_idx: e for e in stored}
    assert by_group[0].kv_cache_spec_kind == "full_attention"
    assert by_group[1].kv_cache_spec_kind == "sliding_window"
    assert by_group[1].kv_cache_spec_sliding_window == 64
    # /tokenize's tokens hash to exactly what the engine published. Full attention keeps
    # every block; the window only the cdiv(64 - 1, 16) = 4 blocks before the replay
    # boundary -- all the resend above needed for its hit.
    end = full_hit // 16
    assert by_group[0].block_hashes == want
    assert by_group[1].block_hashes == want[end - 4 : end]
    for g in (0, 1):  # both events cover every full block's tokens
        assert by_group[g].token_ids == tokens[: len(want) * 16]
        assert by_group[g].parent_block_hash is None


async def test_streaming_completion_and_chat_with_usage(swa_engine):
    body = {"max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=swa_engine.url, timeout=30) as client:
        for path, extra in (
            ("/v1/completions", {"prompt": "stream me please"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            async with client.stream("POST", path, json={**body, **extra}) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
            usage = chunks[-1]["usage"]
            assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 4
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert finishes[-1] == "length" and finishes.count("length") == 1
            if path.endswith("chat/completions"):
                assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
                text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
            else:
                text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
            assert len(text.encode()) == 4  # byte-level tokenizer: one byte per token


async def test_chat_next_turn_resumes_at_the_first_prompt_window_and_a_sibling_at_the_junction(
    swa_engine,
):
    msgs = [{"role": "user", "content": "Tell me about prefix caching in detail. " * 3}]
    async with httpx.AsyncClient(base_url=swa_engine.url, timeout=30) as client:

        async def turn(last: str, reply: str) -> tuple[int, int]:
            conv = [
                *msgs,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": last},
            ]
            r = await client.post("/v1/chat/completions", json={"messages": conv, "max_tokens": 1})
            usage = r.json()["usage"]
            return usage["prompt_tokens"], usage["kv_hit"]["gpu_tokens"]

        r1 = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 40})
        reply = r1.json()["choices"][0]["message"]["content"]
        first_prompt = r1.json()["usage"]["prompt_tokens"]
        second_prompt, second_hit = await turn("More.", reply)
        _, sibling_hit = await turn("Less.", reply)
        _, resend_hit = await turn("More.", reply)
    # Full attention holds the reply's blocks too, but the window group hashes no decode
    # block: the next turn resumes at the first prompt's replay boundary.
    assert second_hit == (first_prompt - 1) // 16 * 16 < first_prompt
    # That lookup's junction (where full attention alone reached, inside the reply) made
    # the second turn keep its window there too, so a sibling turn branching after the
    # reply reuses the reply. (The second turn's replay window alone sits past the
    # branch: the sibling would fall back to the first prompt's window.)
    assert first_prompt < sibling_hit < second_prompt
    assert resend_hit == (second_prompt - 1) // 16 * 16


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "invalid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": []}', 400, "empty"),
        ("/v1/completions", b'{"prompt": [1, 99999]}', 400, "vocab"),
        ("/v1/completions", b'{"prompt": "x", "model": "other"}', 404, "does not exist"),
        (
            "/v1/completions",
            b'{"prompt": "x", "max_tokens": 999999}',
            400,
            "cannot be greater than max_model_len=1024",
        ),
        ("/v1/completions", b'{"prompt": "' + b"a" * 1100 + b'"}', 400, "context length is 1024"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/tokenize", b"{}", 400, "prompt or messages"),
    ],
)
def test_bad_input_gets_openai_style_error(swa_engine, path, body, status, needle):
    resp = httpx.post(
        swa_engine.url + path, content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == status
    err = resp.json()["error"]
    assert needle in err["message"] and err["code"] == status


def test_oversized_body_is_rejected_with_413(swa_engine):
    resp = httpx.post(
        swa_engine.url + "/v1/completions",
        content=b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 413


def test_models_health_and_metrics(swa_engine):
    models = httpx.get(swa_engine.url + "/v1/models").json()
    assert models["data"][0]["id"] == "kvroute-sim"
    assert httpx.get(swa_engine.url + "/health").status_code == 200
    httpx.post(swa_engine.url + "/v1/completions", json={"prompt": "metrics " * 10})
    text = httpx.get(swa_engine.url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "kvroute:cpu_kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in text
    queries = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_queries_total")]
    assert float(queries[0].split()[-1]) > 0


async def test_gpu_overflow_spills_to_cpu_and_later_hits_cpu(tmp_path):
    eng = start_engine(
        tmp_path,
        "--profile", "full", "--gpu-blocks", "48", "--max-model-len", "752",
        "--cpu-blocks", "256", "--blocks-per-chunk", "4", "--time-scale", "50",
    )  # fmt: skip
    try:
        prompts = [f"[{i}] " + f"document {i} body text. " * 30 for i in range(4)]
        async with (
            httpx.AsyncClient(base_url=eng.url, timeout=30) as client,
            ZmqEventSubscriber(eng.events, eng.replay, start_seq=0) as sub,
        ):
            for p in prompts:  # each prompt needs ~43 blocks: later ones evict earlier
                r = await client.post("/v1/completions", json={"prompt": p, "max_tokens": 1})
                assert r.status_code == 200
            again = (await client.post("/v1/completions", json={"prompt": prompts[0]})).json()
            events = await _collect(
                sub, lambda evs: any(getattr(e, "medium", None) == "CPU" for e in evs)
            )
    finally:
        assert eng.stop() == 0
    cpu_events = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    # vLLM's default payload: a placeholder naming the chunk's last hash.
    assert cpu_events and all(
        e.block_size == 0 and not e.token_ids and len(e.block_hashes) == 1 for e in cpu_events
    )
    assert again["usage"]["kv_hit"]["cpu_tokens"] > 0
    assert "Application shutdown complete" in eng.log.read_text()


def test_sigterm_shuts_down_cleanly(tmp_path):
    eng = start_engine(
        tmp_path, "--profile", "mamba-hybrid", "--max-model-len", "4096", "--time-scale", "50"
    )
    r = httpx.post(eng.url + "/v1/completions", json={"prompt": "bye " * 20, "max_tokens": 2})
    assert r.status_code == 200
    assert eng.stop(signal.SIGTERM) == 0
    log = eng.log.read_text()
    assert "Application shutdown complete" in log and "Traceback" not in log
