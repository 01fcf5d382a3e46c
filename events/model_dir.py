"""A HuggingFace model directory's tokenizer, giving exactly the token ids vLLM gives.

vLLM tokenizes with ``transformers.AutoTokenizer`` over the model dir; for a
``tokenizer.json`` that is the ``tokenizers`` pipeline plus what transformers layers on
top, which this module repeats with ``tokenizers`` alone (no transformers, no torch):

- the named special tokens (``bos_token``... from ``tokenizer_config.json``, else
  ``special_tokens_map.json``) and ``added_tokens_decoder`` entries missing from
  ``tokenizer.json`` are added as special added tokens, so text spelling them matches them
  unless ``split_special_tokens`` is set;
- BOS/EOS come from ``tokenizer.json``'s post-processor alone: transformers 5 (vLLM 0.32's)
  drops the config's ``add_bos_token`` / ``add_eos_token`` when a ``tokenizer.json`` exists
  (transformers 4's ``LlamaTokenizerFast`` honoured them: older vLLMs may differ there);
- no padding and no truncation (vLLM rejects over-long prompts rather than cut them).

transformers 5 rebuilds the normalizer and pre-tokenizer of some model-specific classes
(``tokenizer_class`` such as ``LlamaTokenizer``) from its own code rather than reading them
from ``tokenizer.json``; they are meant to agree, and the generic
``PreTrainedTokenizerFast`` always does. The class is logged at load for that reason.

Completions (``prompt``) are encoded with special tokens, as vLLM's default
``add_special_tokens=True``; chat renders the template (``events.chat_template``), then
encodes without them. The chat template comes from ``chat_template.jinja``, else the
config's ``chat_template`` (a string, or named templates with a ``default``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from events.chat_template import ChatTemplate, ChatTemplateError

__all__ = ["ModelDirTokenizer"]

log = logging.getLogger(__name__)

SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A config's special token: a string, or a serialized ``AddedToken`` dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(content := value.get("content"), str):
        return content
    return None


def _added_token(value: Any, special: bool = True) -> Any:
    from tokenizers import AddedToken

    if isinstance(value, Mapping):
        opts = {
            k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value
        }
        return AddedToken(value["content"], special=special or bool(value.get("special")), **opts)
    return AddedToken(str(value), special=special)


class ModelDirTokenizer:
    """``tokenizer.json`` and its transformers side files, as vLLM's tokenizer uses them."""

    def __init__(self, model_dir: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError("a model dir tokenizer needs `pip install tokenizers`") from exc
        root = Path(model_dir)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(
                f"{root} has no tokenizer.json: give the model dir vLLM serves (HF format), "
                "a tokenizer.json path, or 'remote'"
            )
        self.name = str(root)
        tok = _HF.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        specials_map = _read_json(root / "special_tokens_map.json")
        raw = {k: config.get(k, specials_map.get(k)) for k in SPECIAL_NAMES}
        self.special_tokens = {k: t for k, v in raw.items() if (t := _token_text(v)) is not None}

        self._add_missing_tokens(tok, config, raw)
        tok.no_padding()
        tok.no_truncation()
        tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        source = self._chat_source(root, config)
        self.chat_template = None if source is None else ChatTemplate(source, self.special_tokens)
        log.info(
            "tokenizer from %s: class %s, %d ids, chat template %s",
            root,
            config.get("tokenizer_class", "unset"),
            self.vocab_size,
            "yes" if source else "none (chats are routed on load)",
        )

    def _add_missing_tokens(self, tok: Any, config: dict[str, Any], raw: dict[str, Any]) -> None:
        """transformers adds ``added_tokens_decoder`` entries, the named specials and the
        extra specials that ``tokenizer.json`` lacks, in that order, as special tokens."""
        have = set(tok.get_added_tokens_decoder().values())
        present = {str(t) for t in have} | {t.content for t in have}
        todo: list[Any] = []
        decoder = config.get("added_tokens_decoder") or {}
        for _, value in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            if isinstance(value, Mapping) and value.get("content") not in present:
                todo.append(_added_token(value, special=bool(value.get("special"))))
        extras = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        if isinstance(extras, Mapping):
            extras = list(extras.values())
        wanted = [v for v in raw.values() if v is not None] + list(extras or [])
        for value in wanted:
            text = _token_text(value)
            if text is not None and text not in present and text not in {t.content for t in todo}:
                todo.append(_added_token(value))
        if todo:
            tok.add_tokens(todo)

    @staticmethod
    def _chat_source(root: Path, config: dict[str, Any]) -> str | None:
        """``chat_template.jinja`` wins over the config's entry, as in transformers."""
        path = root / "chat_template.jinja"
        if path.is_file():
            return path.read_text(encoding="utf-8")
        entry = config.get("chat_template")
        if isinstance(entry, list):  # named templates: [{"name": ..., "template": ...}]
            entry = {t.get("name"): t.get("template") for t in entry if isinstance(t, Mapping)}
        if isinstance(entry, Mapping):
            entry = entry.get("default")
        return entry if isinstance(entry, str) else None

    def encode(self, text: str) -> list[int]:
        """The text alone: no BOS/EOS (what a chat render is tokenized with)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A completion's prompt as vLLM encodes it (``add_special_tokens=True``)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_chat(
        self, messages: Sequence[Any], options: Mapping[str, Any] | None = None
    ) -> list[int] | None:
        """A chat request's prompt ids; ``options`` are the request's fields
        (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
        ``documents``, ``reasoning_effort``). ``None`` where the ids cannot be told here:
        no chat template, ``tools``, media parts, or a request-level ``chat_template``.
        Raises ``ValueError``/``TypeError`` where vLLM would answer 400."""
        opts = options or {}
        if self.chat_template is None or opts.get("tools") or opts.get("chat_template"):
            return None
        conversation = self.chat_template.messages(messages)
        if conversation is None:
            return None
        kwargs = self._template_kwargs(opts)
        text = self.chat_template.render(conversation, **kwargs)
        return self.encode(text)

    @staticmethod
    def _template_kwargs(opts: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's merge: request fields that are set override ``chat_template_kwargs``."""
        user = opts.get("chat_template_kwargs") or {}
        if not isinstance(user, Mapping) or {"chat_template", "tokenize"} & set(user):
            raise ChatTemplateError("chat_template_kwargs must be an object without those keys")
        set_fields: dict[str, Any] = {
            "add_generation_prompt": opts.get("add_generation_prompt", True),
            "continue_final_message": opts.get("continue_final_message", False),
            "documents": opts.get("documents"),
            "reasoning_effort": opts.get("reasoning_effort"),
        }
        effort = opts.get("reasoning_effort")
        if effort is not None and "enable_thinking" not in user:
            set_fields["enable_thinking"] = effort != "none"
        return {**user, **{k: v for k, v in set_fields.items() if v not in (None, "auto")}}

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids))
