"""Write a tiny random LoRA adapter for the tiny Llama model (``make_models.py``), in the
PEFT layout vLLM loads (``adapter_config.json`` + ``adapter_model.safetensors``), so a real
vLLM CPU server can serve ``--lora-modules NAME=DIR`` with nothing downloaded.

Run with the real-vLLM venv's python (torch and safetensors): ``python make_lora.py OUT``.
Rank 8 on ``q_proj``/``v_proj`` of both layers; small random weights, so the adapter's
outputs differ from the base model's while staying finite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK, HIDDEN, LAYERS = 8, 64, 2  # the tiny Llama's shape (make_models.py)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g) * 0.01
            tensors[f"{base}.lora_B.weight"] = torch.randn(HIDDEN, RANK, generator=g) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
