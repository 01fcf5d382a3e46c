"""A model's own chat template, rendered as transformers renders it for vLLM.

vLLM turns ``messages`` into token ids in three steps, and the router must repeat each or
its block hashes never match: (1) normalize the OpenAI messages (text parts joined with
``"\\n"``, or kept as ``{"type": "text"}`` parts when the template loops over content;
``developer`` folded into ``system`` where the template has no such role; tool-call
arguments parsed to objects), (2) render the jinja ``chat_template`` in a sandbox with
``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a
``tojson`` that keeps non-ASCII, and the named special tokens (``bos_token``...) as
variables, (3) tokenize the text with ``add_special_tokens=False`` (the caller's part).

Only text conversations are reproduced: messages with images or other media, and requests
with ``tools`` (vLLM dumps them through its pydantic models first), give ``None``: "cannot
tell", so the router routes them on load alone. ``jinja2`` is imported lazily (on first
template), as ``events/`` depends on no third-party package at import time.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["ChatTemplate", "ChatTemplateError"]

# transformers marks the end of the message to continue with this, then cuts there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template rejected the conversation (vLLM answers 400)."""


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (jinja's own escapes ``<>&'``)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> Any:
    """The sandboxed environment transformers compiles chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training
        masks): renders its body unchanged, as transformers does when not tracking."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _iterates_content(ast: Any) -> bool:
    """Whether the template loops over a message's content (``for part in
    message['content']``, or over a variable named ``content``): vLLM then hands it
    OpenAI-style parts instead of one string (its "openai" content format)."""
    import jinja2.nodes as n

    def unwrap(node: Any) -> Any:
        while isinstance(node, n.Filter | n.Test) and node.node is not None:
            node = node.node
        return node

    for loop in ast.find_all(n.For):
        it = unwrap(loop.iter)
        if isinstance(it, n.Getitem) and isinstance(it.arg, n.Slice):
            it = unwrap(it.node)
        if isinstance(it, n.Name) and it.name == "content":
            return True
        if isinstance(it, n.Getitem) and isinstance(it.arg, n.Const) and it.arg.value == "content":
            return True
        if isinstance(it, n.Getattr) and it.attr == "content":
            return True
    return False


class ChatTemplate:
    """One compiled template plus the variables every render gets (special tokens)."""

    def __init__(self, source: str, variables: Mapping[str, str] | None = None) -> None:
        env = _environment()
        self.source = source
        self._template = env.from_string(source)
        self._variables = dict(variables or {})
        self.parts = _iterates_content(env.parse(source))
        self._developer = '"developer"' in source or "'developer'" in source

    def messages(self, messages: Sequence[Any]) -> list[dict[str, Any]] | None:
        """vLLM's normalized conversation for text messages; ``None`` for media parts.

        Raises ``TypeError`` for malformed messages (vLLM answers 400)."""
        out = [self._message(m) for m in messages]
        conv = [m for m in out if m is not None]
        if len(conv) < len(out):
            return None
        if not self._developer and any(m["role"] == "developer" for m in conv):
            conv = _fold_developer(conv)
        return conv

    def _message(self, m: Any) -> dict[str, Any] | None:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TypeError("a chat message needs a string role")
        role, content = m["role"], m.get("content")
        raw = [] if content is None else [content] if isinstance(content, str) else content
        if not isinstance(raw, list):
            raise TypeError("message content must be a string or a list of parts")
        texts: list[str] = []
        for part in raw:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise TypeError("a text part needs a string text")
                texts.append(part["text"])
            else:
                return None  # media, or a part type whose rendering vLLM decides
        out: dict[str, Any] = {"role": role}
        if self.parts and role != "tool":
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)
        if role == "assistant":
            if isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
                out["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
            if m.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        return out

    def render(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: Any = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text (vLLM then tokenizes it without special tokens)."""
        import jinja2

        final: str | None = None
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message excludes add_generation_prompt")
            conversation, final = self._tag_final(conversation)
        try:
            text: str = self._template.render(
                messages=conversation,
                tools=None,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **{**self._variables, **kwargs},
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        if final is not None:
            text = _cut_at_tag(text, final)
        return text

    def _tag_final(self, conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        """Mark the end of the last message so the render can be cut right after it."""
        if not conversation or "content" not in self.source:
            raise ChatTemplateError("continue_final_message: no final content to continue")
        conversation = copy.deepcopy(conversation)
        content = conversation[-1].get("content")
        if isinstance(content, list):
            for part in reversed(content):
                if "text" in part:
                    final = part["text"]
                    part["text"] = final + _CONTINUE_TAG
                    return conversation, final
            raise ChatTemplateError("continue_final_message: no text to continue")
        if content is None:
            raise ChatTemplateError("continue_final_message: the final message has no content")
        conversation[-1]["content"] = content + _CONTINUE_TAG
        return conversation, content


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the template dropped the final message")
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def _tool_call(call: Any) -> dict[str, Any]:
    """vLLM parses a tool call's JSON ``arguments`` to an object ({} when it is not one)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise TypeError("tool_calls entries must be function calls")
    call = copy.deepcopy(dict(call))
    args = call["function"].get("arguments")
    if not args:
        parsed: Any = {}
    elif isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = {}
    else:
        parsed = args
    call["function"] = {**call["function"], "arguments": parsed if isinstance(parsed, dict) else {}}
    out: dict[str, Any] = call
    return out


def _fold_developer(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM, for templates without a ``developer`` role: developer becomes system, and
    system messages not already alone at the front are merged into one there."""
    conv = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conv]
    systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if systems in ([], [0]):
        return conv
    texts = []
    for i in systems:
        c = conv[i].get("content", "")
        if isinstance(c, list):
            c = "\n".join(p["text"] for p in c if isinstance(p, Mapping) and "text" in p)
        if c:
            texts.append(c)
    merged = {"role": "system", "content": "\n\n".join(texts)}
    return [merged, *(m for m in conv if m["role"] != "system")]
