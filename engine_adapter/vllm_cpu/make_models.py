"""Write tiny random-weight models for real-vLLM tests: ``python make_models.py OUTDIR``.

Runs with the vLLM venv's python (it imports torch/transformers/tokenizers from there, never
from the project): nothing can be fetched from a model hub, and tests need models whose KV
cache layout is known (hybrid groups) and whose tokenizer is our byte tokenizer (token id ==
UTF-8 byte), so that router-side hashes and vLLM's hashes are computed over the same ids.

Writes ``OUTDIR/{gemma3,qwen3next,llama}`` and ``OUTDIR/.stamp`` (a hash of this file's
source) last; with a matching stamp it does nothing, so callers can key a cache dir on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models

logger = logging.getLogger("make_models")

SEED = 0
VOCAB_SIZE = 512
SPECIALS = ("<bos>", "<eos>", "<pad>")  # ids 256, 257, 258
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
MAX_POSITIONS = 4096
# The project's documented template (events/tokenizer.py apply_chat_template).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
CHAT_EXAMPLE = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "héllo wörld"},
]
CHAT_EXPECTED = "<|system|>\nbe brief\n<|user|>\nhéllo wörld\n<|assistant|>\n"
PROBE = "héllo wörld\n<|user|> <eos><bos>  \t<0x41>"


def source_hash() -> str:
    """What the cache is keyed on: any change to this script makes new models."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def byte_tokenizer() -> Tokenizer:
    """Token id == UTF-8 byte for any text: 256 byte tokens, byte fallback, no merges.

    No normalizer and no pre-tokenizer (spaces stay 0x20), no post-processor (no BOS).
    The specials live in the model vocab only, not as added tokens, so text that spells
    ``<eos>`` is still split into its bytes.
    """
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({s: 256 + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.ByteFallback()
    return tok


def write_tokenizer(out: Path) -> None:
    """tokenizer.json plus the transformers side files vLLM's AutoTokenizer reads."""
    byte_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # transformers registers the specials as added tokens; without this it would match
        # "<eos>" spelled out in text instead of splitting it into bytes.
        "split_special_tokens": True,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))


def check_tokenizer(out: Path) -> None:
    """Fail loudly if the saved tokenizer is not exactly bytes or the template drifts."""
    expected = list(PROBE.encode("utf-8"))
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    got = raw.encode(PROBE).ids
    assert got == expected, f"tokenizers: {got} != {expected}"
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    for add in (True, False):
        got = hf(PROBE, add_special_tokens=add)["input_ids"]
        assert got == expected, f"transformers (add_special_tokens={add}): {got} != {expected}"
    assert hf.decode(expected) == PROBE, hf.decode(expected)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    rendered = hf.apply_chat_template(CHAT_EXAMPLE, tokenize=False, add_generation_prompt=True)
    assert rendered == CHAT_EXPECTED, repr(rendered)


def _common() -> dict:
    """What every tiny model shares: the byte vocabulary and its special ids, and a 64-wide
    body with 2 query heads (small enough to start in seconds on a CPU)."""
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
    }


def gemma3() -> transformers.PreTrainedModel:
    """6 KV cache groups in vLLM: layers 0-4 sliding window 64, layer 5 full attention."""
    cfg = transformers.Gemma3TextConfig(
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=64,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        **_common(),
    )
    return transformers.Gemma3ForCausalLM(cfg)


def qwen3next() -> transformers.PreTrainedModel:
    """4 groups in vLLM: 3 Mamba (gated delta net) + 1 full attention.

    Head dims 64 (32 fails on CPU: "Unexpected head dim size"); every layer MoE because the
    model needs at least one MoE layer.
    """
    cfg = transformers.Qwen3NextConfig(
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **_common(),
    )
    return transformers.Qwen3NextForCausalLM(cfg)


def llama() -> transformers.PreTrainedModel:
    """The plain case: one full-attention group."""
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=32,
        **_common(),
    )
    return transformers.LlamaForCausalLM(cfg)


MODELS: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "gemma3": gemma3,
    "qwen3next": qwen3next,
    "llama": llama,
}


def main(outdir: Path) -> None:
    stamp = outdir / ".stamp"
    digest = source_hash()
    if stamp.is_file() and stamp.read_text().strip() == digest:
        logger.info("models in %s are current (%s)", outdir, digest)
        return
    outdir.mkdir(parents=True, exist_ok=True)
    for name, build in MODELS.items():
        torch.manual_seed(SEED)
        model = build().to(torch.bfloat16).eval()  # what vLLM runs on CPU anyway
        out = outdir / name
        model.save_pretrained(str(out))
        write_tokenizer(out)
        check_tokenizer(out)
        logger.info("wrote %s (%d params)", out, sum(p.numel() for p in model.parameters()))
    (outdir / "README.md").write_text(
        "Tiny random-weight models for tests/vllm, written by make_models.py "
        f"(source hash {digest}); token id == UTF-8 byte. Safe to delete.\n"
    )
    stamp.write_text(digest + "\n")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if len(sys.argv) != 2:
        sys.exit("usage: make_models.py OUTDIR")
    main(Path(sys.argv[1]))
