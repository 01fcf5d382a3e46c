"""Tokenizers shared by the simulated engine and the router.

The router must tokenize exactly as the engine does, or its block hashes never match. The
default is byte-level (token id = UTF-8 byte), so any text works with no model files; a
HuggingFace ``tokenizer.json`` can be used instead (optional ``tokenizers`` package). The
chat template is deliberately simple and documented so other tools can reproduce it:

    <|{role}|>\\n{content}\\n   for each message, then   <|assistant|>\\n
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the token ids (vocab 256)."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t & 0xFF for t in token_ids).decode("utf-8", errors="replace")


class HFTokenizer:
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
    """``None``/"byte" -> byte-level; otherwise a path to a ``tokenizer.json``."""
    if spec in (None, "", "byte"):
        return ByteTokenizer()
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
