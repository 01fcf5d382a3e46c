"""Model dirs with small tokenizers, written with ``tokenizers`` at test time.

Shared by the unit tests (ids checked by hand: the byte dirs give id == UTF-8 byte, specials
from 256) and the real-vLLM conformance tests (the same dirs, checked against transformers
in the vLLM venv). Nothing here imports transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = 256, 257, 258

# Whitespace-sensitive on purpose: without trim_blocks/lstrip_blocks every tag line would
# leave a newline or indentation in the prompt. Uses bos_token, a system-message branch,
# raise_exception and loop controls (continue, break).
CHAT_TEMPLATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = 'You are helpful.' %}
    {%- set rest = messages %}
{%- endif %}
[SYS] {{ system }}
{% for m in rest %}
    {% if m['role'] == 'system' %}
        {{ raise_exception('System message must be first') }}
    {% endif %}
    {% if m['content'] == 'skip me' %}
        {% continue %}
    {% endif %}
    {% if loop.index > 6 %}
        {% break %}
    {% endif %}
[{{ m['role'] | upper }}] {{ m['content'] | trim }}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]{% if greeting is defined %} {{ greeting }}{% endif %}

{% endif %}
"""

# Loops over OpenAI content parts (vLLM's "openai" content format) and knows `developer`.
PARTS_TEMPLATE = """\
{% for m in messages %}
<|im_start|>{{ m['role'] }}
{% if m['content'] is string %}{{ m['content'] }}{% else %}
{% for part in m['content'] %}{{ part['text'] }}{% if not loop.last %} | {% endif %}{% endfor %}
{% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def byte_tokenizer(specials: Sequence[str] = ("<bos>", "<eos>", "<pad>")) -> Tokenizer:
    """id == UTF-8 byte for any text; ``specials`` in the model vocab from 256 (not added
    tokens: transformers adds the named ones, which is part of what is tested)."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.ByteFallback()
    return tok


def trained_tokenizer() -> Tokenizer:
    """A byte-level BPE with merges (a realistic pipeline: ByteLevel pre-tokenizer, specials
    as added tokens) and a ``<s> $A`` post-processor."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["hello world, the quick brown fox jumps over the lazy dog. " * 20]
    corpus += ["system user assistant: you are a helpful assistant. héllo wörld"] * 5
    tok.train_from_iterator(corpus, trainer)
    s = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", s)]
    )
    return tok


def write_model_dir(
    out: Path,
    tok: Tokenizer,
    config: dict[str, Any],
    *,
    chat_template_file: str | None = None,
    special_tokens_map: dict[str, Any] | None = None,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if chat_template_file is not None:
        (out / "chat_template.jinja").write_text(chat_template_file)
    if special_tokens_map is not None:
        (out / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return out


def bos_postprocessor_dir(out: Path) -> Path:
    """Byte ids; ``<bos>`` an added special token; tokenizer.json's post-processor adds it;
    the whitespace-sensitive template."""
    tok = byte_tokenizer()
    tok.add_special_tokens([AddedToken("<bos>", special=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A:0", pair="<bos> $A:0 $B:1", special_tokens=[("<bos>", BOS)]
    )
    cfg = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}
    return write_model_dir(out, tok, cfg)


def config_bos_eos_dir(out: Path, *, split_special_tokens: bool = False) -> Path:
    """Byte ids; no post-processor; add_bos_token/add_eos_token in the config (which
    transformers 5 ignores next to a tokenizer.json); the specials only in the model vocab
    and named in special_tokens_map.json (transformers adds them as special tokens)."""
    cfg: dict[str, Any] = {"add_bos_token": True, "add_eos_token": True}
    if split_special_tokens:
        cfg["split_special_tokens"] = True
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    return write_model_dir(out, byte_tokenizer(), cfg, special_tokens_map=specials)


def added_tokens_dir(out: Path) -> Path:
    """Byte ids; added tokens of each kind (special, not special, an extra special only in
    the config); chat_template.jinja (over the config's) looping over content parts."""
    tok = byte_tokenizer(("<bos>", "<eos>", "<pad>", "<|im_start|>", "<|im_end|>", "<|x|>"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True)])
    tok.add_tokens([AddedToken("<|im_end|>", special=False, normalized=False)])
    cfg = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "additional_special_tokens": ["<|x|>"],
        "chat_template": "{{ 'the config template loses to chat_template.jinja' }}",
    }
    return write_model_dir(out, tok, cfg, chat_template_file=PARTS_TEMPLATE)


def trained_dir(out: Path) -> Path:
    """A trained byte-level BPE (merges, specials added), ``<s>`` from its post-processor,
    the whitespace-sensitive template with ``<s>`` as bos_token."""
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return write_model_dir(out, trained_tokenizer(), {**cfg, "chat_template": CHAT_TEMPLATE})


def b(text: str) -> list[int]:
    """Byte ids of ``text``."""
    return list(text.encode("utf-8"))
