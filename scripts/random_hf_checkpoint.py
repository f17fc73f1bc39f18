"""Write a random-weight Hugging Face Llama checkpoint of a named shape (sharded safetensors + a byte-level
tokenizer), to time `gpt-fast convert` on a realistic size. Needs transformers (a test dependency).

    python scripts/random_hf_checkpoint.py llama-2-7b /tmp/hf7b [--device cuda]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpt_fast.convert.hf_config import hf_config_dict
from gpt_fast.convert.random_init import byte_tokenizer
from gpt_fast.model.shapes import get_shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape")
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    shape = get_shape(args.shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**hf_config_dict(shape)))
    model = model.to_empty(device=args.device).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    model.save_pretrained(args.output_dir, max_shard_size="5GB")
    byte_tokenizer(shape.vocab_size)[0].save(str(args.output_dir / "tokenizer.json"))
    (args.output_dir / "tokenizer_config.json").write_text(
        '{"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}'
    )


if __name__ == "__main__":
    main()
