"""parse_usage: what the engine reported it had cached, from the end of its answer (the
exactness metrics compare it with the prediction). Anything that is not an OpenAI usage
gives None, never an exception on the response path."""

from __future__ import annotations

import json

import pytest

from router.http.forward import parse_usage


def _body(usage: object) -> bytes:
    return json.dumps({"id": "cmpl-1", "choices": [{"text": "x"}], "usage": usage}).encode()


def test_kv_hit_wins_over_cached_tokens_and_both_are_read() -> None:
    both = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4},
            "kv_hit": {"gpu_tokens": 3, "cpu_tokens": 2}}  # fmt: skip
    assert parse_usage(_body(both), False) == (3, 2)
    assert parse_usage(_body({"prompt_tokens_details": {"cached_tokens": 7}}), False) == (7, 0)
    assert parse_usage(_body({"prompt_tokens": 9}), False) is None
    assert parse_usage(_body(None), False) is None


@pytest.mark.parametrize(
    "tail",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'"usage"',
        b'{"usage": {',
        _body("a string"),
        _body([1]),
        _body({"prompt_tokens_details": "x"}),
        _body({"prompt_tokens_details": {"cached_tokens": "7"}}),
        _body({"kv_hit": {"gpu_tokens": "3", "cpu_tokens": 0}}),
        _body({"kv_hit": {"gpu_tokens": True}}),
    ],
)
def test_what_is_not_a_usage_gives_none(tail: bytes) -> None:
    assert parse_usage(tail, False) is None
    assert parse_usage(b"data: " + tail + b"\n\ndata: [DONE]\n\n", True) is None


def test_a_stream_is_read_from_its_last_chunk_with_usage() -> None:
    chunks = [
        b'data: {"choices": [{"text": "a"}], "usage": null}',
        b"data: " + _body({"kv_hit": {"gpu_tokens": 16, "cpu_tokens": 0}}),
        b'data: {"choices": [], "note": "no usage here"}',
        b"data: [DONE]",
    ]
    assert parse_usage(b"\n\n".join(chunks) + b"\n\n", True) == (16, 0)
