"""The router's in-process tokenization of a model dir: vLLM's ids, or "cannot tell".

Why: with ``--tokenizer MODEL_DIR`` no request waits for a ``/tokenize`` round trip, so the
ids must follow the request's own fields as vLLM does, and anything the router cannot
reproduce must give ``None`` (routed on load) rather than wrong ids.
"""

from __future__ import annotations

from pathlib import Path

import tokkit
from tokkit import BOS, b

from router.decision.tokenize import RoutingTokenizer

USER = [{"role": "user", "content": "x"}]


async def test_model_dir_ids_follow_the_request_fields(tmp_path: Path) -> None:
    rt = RoutingTokenizer(str(tokkit.bos_postprocessor_dir(tmp_path)))
    assert await rt.prompt_ids({"prompt": "ab"}, "completion") == [BOS, *b("ab")]
    body = {"prompt": "ab", "add_special_tokens": False}
    assert await rt.prompt_ids(body, "completion") == b("ab")
    head = [BOS, *b("[SYS] You are helpful.\n[USER] x\n")]
    assert await rt.prompt_ids({"messages": USER}, "chat") == head + b("[ASSISTANT]\n")
    body = {"messages": USER, "add_generation_prompt": False}
    assert await rt.prompt_ids(body, "chat") == head


async def test_what_cannot_be_reproduced_is_cannot_tell(tmp_path: Path) -> None:
    rt = RoutingTokenizer(str(tokkit.bos_postprocessor_dir(tmp_path)))
    late_system = [*USER, {"role": "system", "content": "late"}]  # raise_exception
    assert await rt.prompt_ids({"messages": late_system}, "chat") is None
    assert await rt.prompt_ids({"messages": USER, "tools": [{"type": "function"}]}, "chat") is None
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert await rt.prompt_ids({"messages": [{"role": "user", "content": [image]}]}, "chat") is None
    assert await rt.prompt_ids({"messages": [{"content": "no role"}]}, "chat") is None


async def test_the_hot_path_keeps_the_fields_that_change_the_ids(tmp_path: Path) -> None:
    """The proxy decodes only routing fields from a body; those that change the prompt's
    ids must be among them, or a request routed through it is tokenized as if unset."""
    import json

    from router.http.fastpath import parse_body

    rt = RoutingTokenizer(str(tokkit.bos_postprocessor_dir(tmp_path)))
    head = [BOS, *b("[SYS] You are helpful.\n[USER] x\n")]
    raw = {"model": "m", "messages": USER, "add_generation_prompt": False, "max_tokens": 3}
    kind, data = parse_body(json.dumps(raw).encode(), None)
    assert await rt.prompt_ids(data, kind) == head
    raw = {"model": "m", "messages": USER, "tools": [{"type": "function"}]}
    kind, data = parse_body(json.dumps(raw).encode(), None)
    assert await rt.prompt_ids(data, kind) is None
    kind, data = parse_body(b'{"prompt": "ab", "add_special_tokens": false}', "completion")
    assert await rt.prompt_ids(data, kind) == b("ab")
