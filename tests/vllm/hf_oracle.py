"""transformers' token ids for a model dir: run by the vLLM venv's python, never imported.

    python hf_oracle.py MODEL_DIR < cases.json > ids.json

``cases.json``: ``{"prompts": [str, ...], "chats": [{"messages": [...], **kwargs}, ...]}``;
prompts are encoded as vLLM encodes a completion (``tok(prompt)``: special tokens added),
chats as vLLM's renderer does (``apply_chat_template(..., tokenize=True)``, default
``add_generation_prompt=True``; other kwargs pass through). A chat the template rejects
gives ``{"error": message}``.
"""

from __future__ import annotations

import json
import sys

from transformers import AutoTokenizer


def main(model_dir: str) -> None:
    cases = json.load(sys.stdin)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in cases.get("prompts", [])]
    chats = []
    for case in cases.get("chats", []):
        kwargs = {"add_generation_prompt": True, **case}
        messages = kwargs.pop("messages")
        try:
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
            chats.append(list(ids))
        except Exception as exc:  # the template said no: vLLM answers 400
            chats.append({"error": str(exc)})
    json.dump({"prompts": prompts, "chats": chats}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
