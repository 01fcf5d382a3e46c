"""Tokenizers shared by the simulated engine and the router.

The router must tokenize exactly as the engine does, or its block hashes never match. The
default is byte-level (token id = UTF-8 byte), so any text works with no model files; a
HuggingFace ``tokenizer.json`` can be used instead (optional ``tokenizers`` package). Both
use a deliberately simple chat template, documented so other tools can reproduce it:

    <|{role}|>\\n{content}\\n   for each message, then   <|assistant|>\\n

A model directory (what vLLM serves) gives ``events.model_dir.ModelDirTokenizer`` instead:
vLLM's own ids, with the model's chat template and BOS/EOS rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    """``encode`` is the text alone; ``encode_prompt`` and ``encode_chat`` are what the
    engine feeds for a completion's prompt string and a chat's messages."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_chat(
        self, messages: Sequence[Any], options: Mapping[str, Any] | None = None
    ) -> list[int] | None: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class _DocumentedChat:
    """Prompts as they are; chats with the documented template (``options`` unused)."""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_chat(
        self, messages: Sequence[Any], options: Mapping[str, Any] | None = None
    ) -> list[int] | None:
        return self.encode(apply_chat_template(messages))


class ByteTokenizer(_DocumentedChat):
    """UTF-8 bytes are the token ids (vocab 256)."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t & 0xFF for t in token_ids).decode("utf-8", errors="replace")


class HFTokenizer(_DocumentedChat):
    """A HuggingFace ``tokenizer.json`` loaded with the ``tokenizers`` package."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError("tokenizer.json support needs `pip install tokenizers`") from exc
        self._tok = _HF.from_file(str(path))
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids))


def load_tokenizer(spec: str | None = None) -> Tokenizer:
    """``None``/"byte" -> byte-level; a directory -> the model's own tokenizer (vLLM's
    ids); otherwise a path to a ``tokenizer.json``."""
    if spec in (None, "", "byte"):
        return ByteTokenizer()
    assert spec is not None
    if Path(spec).is_dir():
        from events.model_dir import ModelDirTokenizer

        return ModelDirTokenizer(spec)
    return HFTokenizer(spec)


def apply_chat_template(messages: Sequence[dict]) -> str:
    """Render OpenAI chat messages with the documented template (see module docstring)."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content or ''}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)
