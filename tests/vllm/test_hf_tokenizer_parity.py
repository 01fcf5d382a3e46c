"""The router's model-dir tokenizer gives the ids vLLM's tokenizer (transformers) gives.

Why: ``--tokenizer MODEL_DIR`` replaces a ``/tokenize`` round trip per request only if it
is exact; a single id off moves every block hash after it. Model dirs with BOS from the
post-processor, BOS/EOS from the config, added and extra special tokens (matched or split),
a trained byte-level BPE, and chat templates that depend on whitespace control, a system
branch, ``raise_exception``, loop controls and template kwargs; each compared with
``AutoTokenizer`` run by the vLLM venv's python (the running servers' side is checked in
test_harness_smoke). No vLLM server is started here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tokkit
from harness import REPO

from engine_adapter.vllm_cpu import offline_env
from events.chat_template import ChatTemplateError
from events.model_dir import ModelDirTokenizer

pytestmark = pytest.mark.vllm

ORACLE = REPO / "tests" / "vllm" / "hf_oracle.py"
DIRS = {
    "bos_postprocessor": tokkit.bos_postprocessor_dir,
    "config_bos_eos": tokkit.config_bos_eos_dir,
    "config_bos_eos_split": lambda p: tokkit.config_bos_eos_dir(p, split_special_tokens=True),
    "added_tokens": tokkit.added_tokens_dir,
    "trained": tokkit.trained_dir,
}
PROMPTS = [
    "hello world",
    "",
    "héllo wörld <bos><eos> <s></s> <|im_start|>x<|im_end|> <|x|><pad><unk>",
    "  leading and trailing spaces \n\t",
]
SYSTEM = {"role": "system", "content": "Be brief."}
CHATS: list[dict[str, Any]] = [
    {"messages": [SYSTEM, {"role": "user", "content": "  hi  "}]},
    {"messages": [{"role": "user", "content": "hello <s> world"}]},
    {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "skip me"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "héllo"},
            {"role": "user", "content": "three"},
        ]
    },
    {"messages": [{"role": "user", "content": f"m{i}"} for i in range(9)]},  # break at 7
    {"messages": [{"role": "user", "content": "a"}, SYSTEM]},  # raise_exception
    {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "a"}], "greeting": "Sure <eos>"},
]
# Content parts reach the template as they are only where it loops over them (vLLM's
# "openai" content format); elsewhere vLLM joins them first (unit-tested, and checked
# against the servers in test_harness_smoke).
PARTS = [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2 <|x|>"}]
PART_CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "ok"}]},
]


def _oracle(python: Path, model_dir: Path, cases: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [str(python), str(ORACLE), str(model_dir)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        env=offline_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _ours(tok: ModelDirTokenizer, case: dict[str, Any]) -> list[int] | dict[str, str]:
    """A chat case as the router sees the request: request fields plus template kwargs."""
    extra = {k: v for k, v in case.items() if k not in ("messages", "add_generation_prompt")}
    options = {"add_generation_prompt": case.get("add_generation_prompt", True)}
    options["chat_template_kwargs"] = extra
    try:
        ids = tok.encode_chat(case["messages"], options)
    except ChatTemplateError as exc:
        return {"error": str(exc)}
    assert ids is not None
    return ids


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(DIRS))
def test_model_dir_ids_equal_transformers(name: str, vllm_python: Path, tmp_path: Path) -> None:
    model_dir = DIRS[name](tmp_path / name)
    ours = ModelDirTokenizer(model_dir)
    template = ours.chat_template
    chats = [] if template is None else CHATS + (PART_CHATS if template.parts else [])
    want = _oracle(vllm_python, model_dir, {"prompts": PROMPTS, "chats": chats})

    assert [ours.encode_prompt(p) for p in PROMPTS] == want["prompts"]
    got = [_ours(ours, c) for c in chats]
    for case, g, w in zip(chats, got, want["chats"], strict=True):
        if isinstance(w, dict):  # both sides refuse, with the template's own message
            assert g == w, case
        else:
            assert g == w, (case, ours.decode(g), ours.decode(w))
    # The cases exercise what they claim: a rejection, BOS where the post-processor adds
    # one, and none from the config's add_bos_token (transformers 5 ignores it here).
    if template is not None and template.source == tokkit.CHAT_TEMPLATE:
        assert any(isinstance(w, dict) for w in want["chats"])
    if name.startswith("config_bos_eos"):
        assert want["prompts"][0] == tokkit.b(PROMPTS[0])
    elif name in ("bos_postprocessor", "trained"):
        bos = want["prompts"][1]
        assert len(bos) == 1 and all(w[0] == bos[0] for w in want["chats"] if isinstance(w, list))
