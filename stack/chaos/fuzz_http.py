"""Scenario: garbage over HTTP into the router and an engine; oversize bodies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

from stack.chaos.client import new_client
from stack.chaos.fuzz_events import mutate
from stack.chaos.results import ChunkedAnswer, FuzzHttpResult, OversizeAnswer, OversizeResult
from stack.procs import LOOPBACK

_PATHS = ("/v1/completions", "/v1/chat/completions")
_CONTENT_TYPES = [b"application/json", b"text/plain", b"application/x-www-form-urlencoded"]
_CONTENT_TYPES += [b"multipart/form-data; boundary=x", b"application/json; charset=latin-1", b""]
_SPECIAL_HEADERS = [
    (b"content-encoding", b"gzip"),
    (b"accept-encoding", b"br, gzip, zstd"),
    (b"authorization", b"Bearer \xff\xfe"),
    (b"x-kvroute-instance", b"http://127.0.0.1:9/"),
    (b"x-forwarded-host", b"127.0.0.1:9"),
    (b"accept", b"text/event-stream"),
    (b"x-request-id", "caf\u00e9".encode("latin-1")),
    (b"cookie", b"a=" + b"b" * 4000),
]


def _valid_body(rng: random.Random, path: str) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": rng.randrange(0, 12), "stream": rng.random() < 0.5}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": f"hello {rng.random()}"}]
    else:
        body["prompt"] = rng.choice([f"fuzz {rng.random()}", [rng.randrange(256)] * 5])
    if rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return body


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice(
            [
                None,
                True,
                0,
                -1,
                2**70,
                1.5,
                float("nan"),
                float("inf"),
                "",
                "x" * 50,
                "\u00e9\U0001f600",
            ]
        )
    if r < 0.75:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    keys = ["prompt", "messages", "max_tokens", "stream", "model", "role", "content", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def http_cases(n: int, seed: int = 0) -> list[tuple[str, list[tuple[bytes, bytes]], bytes]]:
    """``n`` (path, headers, body) cases: mutated valid bodies, valid bodies with one field
    replaced by junk, random JSON, raw bytes, classics (deep nesting, huge numbers, bad
    UTF-8); headers with odd content types, latin-1 values and routing-looking names."""
    rng = random.Random(seed)
    classics = [
        b"",
        b"null",
        b"[]",
        b'"prompt"',
        b"[" * 100_000,
        b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"prompt": "x", "max_tokens": 1e999}',
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "\xff\xfe"}',
        b"\xef\xbb\xbf{}",
        b'{"prompt": [1, 2, -1]}',
        b'{"prompt": [340282366920938463463374607431768211456]}',
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        b'{"messages": [{"content": {"a": 1}}]}',
        b'{"prompt": "x", "stream": true, "stream_options": 5}',
        b'{"prompt": "x", "model": "http://127.0.0.1:9/v1"}',
    ]
    out = []
    for i in range(n):
        path = rng.choice(_PATHS)
        r = rng.random()
        if i < len(classics):
            body = classics[i]
        elif r < 0.3:
            body = mutate(rng, json.dumps(_valid_body(rng, path)).encode())
        elif r < 0.55:
            b = _valid_body(rng, path)
            b[rng.choice([*b, "model", "n"])] = _random_json(rng)
            body = json.dumps(b).encode()
        elif r < 0.8:
            body = json.dumps(_random_json(rng)).encode()
        elif r < 0.9:
            body = rng.randbytes(rng.randrange(200))
        else:
            body = json.dumps(_valid_body(rng, path)).encode()
        headers = [(b"content-type", rng.choice(_CONTENT_TYPES))]
        for _ in range(rng.randrange(4)):
            if rng.random() < 0.4:
                headers.append(rng.choice(_SPECIAL_HEADERS))
            else:
                key = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789-", k=8))
                value = bytes(
                    rng.choice([*range(0x20, 0x7F), *range(0x80, 0x100)]) for _ in range(12)
                )
                headers.append((b"x-" + key.encode(), value.strip() or b"v"))
        out.append((path, headers, body))
    return out


def judge_http(status: int, content_type: str, raw: bytes) -> str | None:
    """None if the answer is acceptable: a 2xx with a well-formed body, or a 4xx (or 502,
    503, 504) whose JSON body carries ``error``; else what is wrong."""
    if 200 <= status < 300:
        if "text/event-stream" in content_type:
            lines = [ln for ln in raw.decode(errors="replace").splitlines() if ln]
            for ln in lines:
                if ln != "data: [DONE]":
                    json.loads(ln.removeprefix("data: "))
            if not lines or lines[-1] != "data: [DONE]":
                return f"stream without [DONE]: {raw[-200:]!r}"
            return None
        try:
            json.loads(raw)
        except ValueError:
            return f"{status} with a non-JSON body: {raw[:200]!r}"
        return None
    if not (400 <= status < 500 or status in (502, 503, 504)):
        return f"status {status}: {raw[:200]!r}"
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without a JSON error body: {raw[:200]!r}"
    if not isinstance(err, dict) or "message" not in err:
        return f"{status} error body without a message: {raw[:200]!r}"
    return None


async def fuzz_http(
    target: str, cases: list[tuple[str, list[tuple[bytes, bytes]], bytes]], *, concurrency: int = 8
) -> FuzzHttpResult:
    """Send every case to ``target``; each must be judged fine within 30 s, and the target
    must answer ``/health`` afterwards."""
    problems: list[str] = []
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(concurrency)
    async with new_client(concurrency + 2, timeout=30) as client:

        async def one(i: int, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
            async with sem:
                try:
                    async with asyncio.timeout(30):
                        r = await client.post(target + path, content=body, headers=headers)
                except Exception as exc:
                    problems.append(f"case {i} {path} {body[:80]!r}: {type(exc).__name__} {exc}")
                    return
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                verdict = judge_http(r.status_code, r.headers.get("content-type", ""), r.content)
                if verdict is not None:
                    problems.append(f"case {i} {path} {body[:80]!r} {headers}: {verdict}")

        t0 = time.monotonic()
        await asyncio.gather(*(one(i, *case) for i, case in enumerate(cases)))
        wall = time.monotonic() - t0
        health = (await client.get(f"{target}/health")).status_code
    return FuzzHttpResult(
        injected=len(cases),
        problems=problems,
        statuses=dict(sorted(statuses.items())),
        healthy_after=health == 200,
        wall_s=wall,
    )


def _raw_exchange(
    port: int, head: bytes, body: Iterator[bytes], timeout: float
) -> tuple[bytes, int]:
    """Send ``head`` then ``body`` pieces until the server answers; return (answer, body
    bytes sent). Reads as soon as the socket is readable, so an early answer is seen."""
    import select

    sent = 0
    answer = b""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
        s.sendall(head)
        deadline = time.monotonic() + timeout
        for piece in body:
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(piece)
            except OSError:  # the server answered and closed: read what it said
                break
            sent += len(piece)
            if time.monotonic() > deadline:
                break
        s.settimeout(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(OSError):
            while True:
                data = s.recv(65536)
                if not data:
                    break
                answer += data
                if b"\r\n\r\n" in answer and _complete(answer):
                    break
    return answer, sent


def _complete(answer: bytes) -> bool:
    head, _, rest = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":")[1])
    return False


def oversize_checks(port: int, path: str, limit: int) -> OversizeResult:
    """A body over ``limit`` must be refused with 413 before it is read whole: (1) a
    Content-Length announcing 10 GB (only 1 KiB follows), (2) a chunked body that would
    never end (the answer must come after about ``limit`` bytes)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\ncontent-type: application/json\r\n"
    ).encode()
    t0 = time.monotonic()
    answer, _ = _raw_exchange(
        port, head + b"content-length: 10000000000\r\n\r\n", iter([b"{" + b" " * 1023]), 15
    )
    announced = OversizeAnswer(_status(answer), _body(answer), time.monotonic() - t0)

    piece = b" " * 65536
    pieces = (limit + (64 << 20)) // len(piece)

    def endless() -> Iterator[bytes]:
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        for _ in range(pieces):
            yield frame

    t0 = time.monotonic()
    answer, sent = _raw_exchange(port, head + b"transfer-encoding: chunked\r\n\r\n", endless(), 60)
    chunked = ChunkedAnswer(
        status=_status(answer),
        body=_body(answer),
        s=time.monotonic() - t0,
        sent_bytes=sent,
        offered_bytes=pieces * (len(piece) + 8),
    )
    return OversizeResult(announced, chunked)


def _status(answer: bytes) -> int | None:
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _body(answer: bytes) -> Any:
    rest = answer.partition(b"\r\n\r\n")[2]
    try:
        return json.loads(rest)
    except ValueError:
        return rest[:200].decode(errors="replace")
