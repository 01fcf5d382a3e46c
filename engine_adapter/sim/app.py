"""The simulated engine's HTTP surface: vLLM-shaped OpenAI endpoints over ``EngineCore``.

Responses look like vLLM's (SSE ``data:`` chunks, ``[DONE]``, usage chunk on
``stream_options.include_usage``) and also say what was really reused:
``usage.prompt_tokens_details.cached_tokens`` (vLLM's field) and
``usage.kv_hit = {"gpu_tokens", "cpu_tokens"}``. ``system_fingerprint`` names the engine so
benchmarks can attribute load even behind routers that add no header.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from engine_adapter.sim.core import EngineCore, RequestOutput
from engine_adapter.sim.metrics import merged_registry
from engine_adapter.sim.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    error_body,
)
from events.tokenizer import Tokenizer, apply_chat_template

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024


def _error(message: str, status: int, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status)


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel | JSONResponse:
    """Read and validate a JSON body once, at the edge; 4xx with a message otherwise."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        return _error(f"request body over {MAX_BODY_BYTES} bytes", 413, "RequestTooLarge")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return _error(f"request body over {MAX_BODY_BYTES} bytes", 413, "RequestTooLarge")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8, 4300+ digit ints, deep nesting
        return _error(f"invalid JSON body: {exc}", 400)
    if not isinstance(data, dict):
        return _error("request body must be a JSON object", 400)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(f"invalid request: {where}: {first.get('msg')}", 400)


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.gpu_hit_tokens + out.cpu_hit_tokens},
        "kv_hit": {"gpu_tokens": out.gpu_hit_tokens, "cpu_tokens": out.cpu_hit_tokens},
    }


def create_app(
    core: EngineCore | Sequence[EngineCore],
    tokenizer: Tokenizer,
    model_name: str,
    engine_name: str,
    max_model_len: int,
    lora_modules: dict[str, str] | None = None,
) -> FastAPI:
    """``lora_modules``: adapter name -> path, served as vLLM's ``--lora-modules`` are (no
    weights: an adapter request is keyed by ``("lora", name, path)`` on every block)."""
    loras = dict(lora_modules or {})
    # Data-parallel ranks, in rank order: a client picks one with vLLM's
    # ``X-data-parallel-rank`` header; otherwise the least loaded takes it.
    cores = list(core) if isinstance(core, Sequence) else [core]
    registry = merged_registry([c.registry for c in cores])
    turn = itertools.count()

    def _rank(request: Request) -> EngineCore | JSONResponse:
        raw = request.headers.get("x-data-parallel-rank")
        try:
            rank = int(raw) if raw is not None else None
        except ValueError:
            rank = None  # vLLM ignores a header it cannot parse
        if rank is None:
            start = next(turn)
            n = len(cores)
            return min(
                (cores[(start + i) % n] for i in range(n)),
                key=lambda c: len(c.waiting) + len(c.running),
            )
        if not 0 <= rank < len(cores):
            return _error(f"data_parallel_rank {rank} is out of range [0, {len(cores)}).", 400)
        return cores[rank]

    app = FastAPI(title="kvroute simulated engine", docs_url=None, redoc_url=None)
    fingerprint = f"kvroute-engine:{engine_name}"

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(f"invalid request: {exc.errors()[:1]}", 400)

    def _check(
        model: str | None, prompt_ids: list[int], max_tokens: int | None
    ) -> JSONResponse | int:
        """vLLM's request checks (its messages); the output length to run, or a 4xx."""
        if model and model != model_name and model not in loras:
            body = error_body(f"The model `{model}` does not exist.", 404, "NotFoundError")
            body["error"]["param"] = "model"  # as vLLM's check_model
            return JSONResponse(body, status_code=404)
        if not prompt_ids:
            return _error("prompt must not be empty", 400)
        n = len(prompt_ids)
        if n > max_model_len:
            return _error(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your prompt contains {n} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                400,
            )
        if max_tokens is not None and max_tokens > max_model_len:
            return _error(
                f"max_tokens={max_tokens} cannot be greater than max_model_len="
                f"{max_model_len}. Please request fewer output tokens.",
                400,
            )
        room = max_model_len - n  # vLLM clamps the output to the context left
        out = room if max_tokens is None else min(max_tokens, room)
        if out < 1 and (max_tokens is None or max_tokens >= 1):
            return _error(f"max_tokens must be at least 1, got {out}.", 400)
        if any(t >= tokenizer.vocab_size for t in prompt_ids):
            return _error(f"token ids must be < vocab size {tokenizer.vocab_size}", 400)
        return out

    async def _run(
        kind: str,
        prompt_ids: list[int],
        max_tokens: int,
        stream: bool,
        include_usage: bool,
        forced_token: int | None = None,
        cache_salt: str | None = None,
        model: str | None = None,
        core: EngineCore = cores[0],
    ) -> Response:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        lora = (model, loras[model]) if model in loras else None
        served = model if lora is not None else model_name  # vLLM names the adapter
        outputs = core.submit(
            rid, prompt_ids, max_tokens, forced_token=forced_token, cache_salt=cache_salt, lora=lora
        )
        if stream:
            gen = _stream(kind, rid, created, outputs, include_usage, served)
            return StreamingResponse(gen, media_type="text/event-stream")
        token_ids: list[int] = []
        last: RequestOutput | None = None
        try:
            async for out in outputs:
                token_ids.extend(out.new_token_ids)
                last = out
        except RuntimeError as exc:  # the engine failed the request: say why, now
            logger.error("request %s failed: %s", rid, exc)
            return _error(str(exc), 500, "InternalServerError")
        assert last is not None
        text = tokenizer.decode(token_ids)
        if kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": last.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": last.finish_reason,
            }
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": created,
                "model": served,
                "system_fingerprint": fingerprint,
                "choices": [choice],
                "usage": _usage(last),
            },
            headers={"x-kvroute-engine": engine_name},
        )

    async def _stream(
        kind: str,
        rid: str,
        created: int,
        outputs: AsyncIterator[RequestOutput],
        include_usage: bool,
        served: str,
    ) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": served}
        base["system_fingerprint"] = fingerprint

        def chunk(text: str | None, finish: str | None, first: bool = False) -> bytes:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n".encode()

        last: RequestOutput | None = None
        try:
            async for out in outputs:
                if last is None and kind == "chat":
                    # As vLLM: the role chunk goes out with the first output, so the first
                    # byte of the body marks the first token.
                    yield chunk(None, None, first=True)
                last = out
                if out.new_token_ids:
                    yield chunk(tokenizer.decode(out.new_token_ids), None)
                if out.finished:
                    yield chunk(None if kind == "chat" else "", out.finish_reason)
        except Exception as exc:  # the engine failed mid-stream: say so, then end the stream
            logger.exception("request %s failed mid-stream", rid)
            err = error_body(str(exc), 500, "InternalServerError")
            yield f"data: {json.dumps(err)}\n\n".encode()
        if include_usage and last is not None:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(last)})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def _prompt_ids(prompt: str | list[int]) -> list[int]:
        return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _chat_ids(messages: list) -> list[int]:
        return tokenizer.encode(apply_chat_template([m.model_dump() for m in messages]))

    # /tokenize and generation share these, so /tokenize returns exactly what is hashed.

    async def _generate(request: Request, kind: str) -> Response:
        """One OpenAI generation request: parse, vLLM's checks (model, length, DP rank),
        then run it, streamed or not; ``kind`` is "completion" or "chat"."""
        req = await _parse(
            request, CompletionRequest if kind == "completion" else ChatCompletionRequest
        )
        if isinstance(req, JSONResponse):
            return req
        assert isinstance(req, CompletionRequest | ChatCompletionRequest)
        ids = (
            _prompt_ids(req.prompt)
            if isinstance(req, CompletionRequest)
            else _chat_ids(req.messages)
        )
        out = _check(req.model, ids, req.output_len)
        if isinstance(out, JSONResponse):
            return out
        if isinstance(rank := _rank(request), JSONResponse):
            return rank
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _run(
            kind, ids, out, req.stream, usage, req.forced_token, req.cache_salt, req.model, rank
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(request, "chat")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await _parse(request, TokenizeRequest)
        if isinstance(req, JSONResponse):
            return req
        assert isinstance(req, TokenizeRequest)
        if req.messages is not None:
            ids = _chat_ids(req.messages)
        elif req.prompt is not None:
            ids = _prompt_ids(req.prompt)
        else:
            return _error("either prompt or messages is required", 400)
        return JSONResponse(
            {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
        )

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "kvroute",
                    "root": model_name,
                    "max_model_len": max_model_len,
                },
                *(
                    {
                        "id": name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "kvroute",
                        "root": path,
                        "parent": model_name,
                    }
                    for name, path in loras.items()
                ),
            ],
        }

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_external: bool = False) -> JSONResponse:
        """vLLM's dev endpoint: forget the GPU prefix cache (refused while a request holds
        blocks); ``reset_external=true`` also empties the CPU tier."""
        ok = all(c.reset_prefix_cache(reset_external) for c in cores)
        return JSONResponse({"success": ok})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if all(c.healthy for c in cores) else 503)

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> dict:
        """As vLLM 0.32+: each data-parallel rank's publisher config with its endpoints as
        resolved (port offset, a port 0 the OS picked); ranks that publish nothing are
        left out, as vLLM leaves out a null publisher's."""
        out = {}
        for rank, c in enumerate(cores):
            cfg = c.publisher.get_publisher_config()
            if cfg is not None:
                out[str(rank)] = dataclasses.asdict(cfg)
        return out

    @app.get("/metrics")
    async def metrics() -> Response:
        for c in cores:
            c.refresh_metrics()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
