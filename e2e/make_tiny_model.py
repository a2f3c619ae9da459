"""Builds the tiny random-weight Llama that `make e2e-vllm` serves with vLLM's CPU build.

    .venv-vllm/bin/python e2e/make_tiny_model.py OUT_DIR

No model can be downloaded here, and none is needed: with random weights the text vLLM
generates is noise, but its tokens, prefix cache, KV events and /tokenize answers are real.
The tokenizer is llmgw-sim's (sim/assets/tokenizer.json, a byte-level BPE trained
locally by sim/assets/train_tokenizer.py) with the sim's chat template, so the real
engine and the simulator tokenize alike. Deterministic (fixed torch seed); rewrites OUT_DIR.
"""
import argparse
import pathlib
import shutil

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ASSETS = pathlib.Path(__file__).resolve().parent.parent / "sim" / "assets"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    out = parser.parse_args().out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(ASSETS / "tokenizer.json"),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = (ASSETS / "chat_template.jinja").read_text()
    tokenizer.save_pretrained(out)

    # head_dim 64: the CPU attention kernels reject smaller heads.
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1729)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny model in {out}: vocab {len(tokenizer)}, "
          f"{sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
