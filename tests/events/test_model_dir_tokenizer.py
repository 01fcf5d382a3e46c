"""A model dir's tokenizer: the ids vLLM would compute, checked by hand (byte ids).

Why: the router hashes these ids; one extra BOS, one special token split or matched the
other way, or one newline a template keeps, and no block hash matches vLLM's.
(tests/vllm/test_hf_tokenizer_parity.py checks the same dirs against transformers.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokkit
from tokkit import BOS, EOS, PAD, b

from events.chat_template import ChatTemplateError
from events.model_dir import ModelDirTokenizer
from events.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

IM_START, IM_END, X = 259, 260, 261  # added_tokens_dir's


def test_post_processor_bos_on_prompts_only_and_template_bos_once(tmp_path: Path) -> None:
    tok = load_tokenizer(str(tokkit.bos_postprocessor_dir(tmp_path)))
    assert isinstance(tok, ModelDirTokenizer)
    assert tok.encode_prompt("hi <bos>") == [BOS, *b("hi "), BOS]
    assert tok.encode("hi") == b("hi")
    # The template writes bos_token itself; the render is encoded without specials.
    ids = tok.encode_chat([{"role": "user", "content": "x"}])
    assert ids == [BOS, *b("[SYS] You are helpful.\n[USER] x\n[ASSISTANT]\n")]


def test_trim_and_lstrip_blocks_system_branch_and_loop_controls(tmp_path: Path) -> None:
    tok = ModelDirTokenizer(tokkit.bos_postprocessor_dir(tmp_path))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  one  "},
        {"role": "assistant", "content": "skip me"},  # {% continue %}
        *({"role": "user", "content": f"m{i}"} for i in range(8)),  # {% break %} after 6
    ]
    want = "[SYS] Be brief.\n[USER] one\n" + "".join(f"[USER] m{i}\n" for i in range(4))
    assert tok.encode_chat(msgs) == [BOS, *b(want + "[ASSISTANT]\n")]


def test_request_fields_reach_the_template(tmp_path: Path) -> None:
    tok = ModelDirTokenizer(tokkit.bos_postprocessor_dir(tmp_path))
    user = [{"role": "user", "content": "x"}]
    head = [BOS, *b("[SYS] You are helpful.\n[USER] x\n")]
    assert tok.encode_chat(user, {"add_generation_prompt": False}) == head
    kwargs = {"chat_template_kwargs": {"greeting": "Sure"}}
    assert tok.encode_chat(user, kwargs) == head + b("[ASSISTANT] Sure\n")
    # continue_final_message: the prompt stops right after the last message's text.
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    assert tok.encode_chat(user, cont) == [BOS, *b("[SYS] You are helpful.\n[USER] x")]


def test_template_rejection_raises(tmp_path: Path) -> None:
    d = tokkit.bos_postprocessor_dir(tmp_path)
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatTemplateError, match="System message must be first"):
        ModelDirTokenizer(d).encode_chat(bad)


def test_config_add_bos_token_is_ignored_next_to_tokenizer_json(tmp_path: Path) -> None:
    """transformers 5 drops add_bos/eos_token when a tokenizer.json exists; the named
    specials it adds as special tokens, so text spelling them matches them..."""
    tok = ModelDirTokenizer(tokkit.config_bos_eos_dir(tmp_path / "a"))
    assert tok.encode_prompt("a<eos><pad><unk>") == [97, EOS, PAD, *b("<unk>")]
    assert tok.chat_template is None
    assert tok.encode_chat([{"role": "user", "content": "a"}]) is None
    # ...unless split_special_tokens says to spell them out.
    split = ModelDirTokenizer(tokkit.config_bos_eos_dir(tmp_path / "b", split_special_tokens=True))
    assert split.encode_prompt("a<eos>") == b("a<eos>")


def test_added_and_extra_special_tokens_and_content_parts(tmp_path: Path) -> None:
    tok = ModelDirTokenizer(tokkit.added_tokens_dir(tmp_path))
    text = "<|im_start|>a<|im_end|><|x|><bos><pad>"
    assert tok.encode_prompt(text) == [IM_START, 97, IM_END, X, BOS, *b("<pad>")]
    # chat_template.jinja wins; the template loops over content, so parts reach it as parts
    # and a string becomes one part.
    assert tok.chat_template is not None and tok.chat_template.parts
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": "c"}]
    want = [IM_START, *b("user\na | b"), IM_END, *b("\n"), IM_START, *b("assistant\nc"), IM_END]
    assert tok.encode_chat(msgs) == want + b("\n") + [IM_START, *b("assistant\n")]


def test_vllm_message_normalization_for_string_templates(tmp_path: Path) -> None:
    """Text parts joined with newlines; developer folded into one leading system message;
    tool-call arguments parsed to objects."""
    src = (
        "{% for m in messages %}{{ m['role'] }}={{ m['content'] }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %};"
        "{% endfor %}"
    )
    d = tokkit.write_model_dir(tmp_path, tokkit.byte_tokenizer(), {"chat_template": src})
    tok = ModelDirTokenizer(d)
    parts = [{"type": "text", "text": "a"}, "b"]
    call = {"type": "function", "function": {"name": "f", "arguments": '{"k": "é"}'}}
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": parts},
        {"role": "developer", "content": "D"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    assert tok.encode_chat(msgs) == b('system=S\n\nD;user=a\nb;assistant={"k": "é"};')


def test_load_tokenizer_specs(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    d = tokkit.bos_postprocessor_dir(tmp_path / "m")
    as_file = load_tokenizer(str(d / "tokenizer.json"))
    assert isinstance(as_file, HFTokenizer)
    # A tokenizer.json alone keeps the documented behaviour: no BOS, the project's template.
    assert as_file.encode_prompt("hi") == b("hi")
    assert as_file.encode_chat([{"role": "user", "content": "x"}]) == b(
        "<|user|>\nx\n<|assistant|>\n"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_tokenizer(str(empty))
