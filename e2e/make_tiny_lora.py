"""Builds a tiny random LoRA adapter for the tiny model, for the LoRA check of `make e2e-vllm`.

    .venv-vllm/bin/python e2e/make_tiny_lora.py MODEL_DIR OUT_DIR

The adapter is what PEFT's `LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj",
"v_proj"])` + `save_pretrained` writes (`adapter_config.json` and `adapter_model.safetensors`
with PEFT's key names), written here with torch and safetensors so that the vLLM venv needs no
`peft`. Both matrices are random (PEFT would zero lora_B), so the adapter really changes what
the engine computes; its text is noise either way. Shapes come from MODEL_DIR's config.json.
vLLM serves it with `--enable-lora --max-lora-rank 8 --lora-modules NAME=OUT_DIR`.
Deterministic (fixed torch seed); rewrites OUT_DIR.
"""
import argparse
import json
import pathlib
import shutil

import torch
from safetensors.torch import save_file

RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=pathlib.Path)
    parser.add_argument("out", type=pathlib.Path)
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_features = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim,
    }

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    torch.manual_seed(4242)
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float32")
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(RANK, hidden) * 0.02).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(out_features[module], RANK) * 0.02
            ).to(dtype)
    save_file(tensors, str(args.out / "adapter_model.safetensors"), metadata={"format": "pt"})

    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(args.model.resolve()),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (args.out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    print(f"tiny LoRA adapter in {args.out}: rank {RANK} on {', '.join(TARGETS)}, "
          f"{sum(t.numel() for t in tensors.values())} parameters")


if __name__ == "__main__":
    main()
