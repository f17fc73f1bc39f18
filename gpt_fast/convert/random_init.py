"""Random-weight checkpoints of a named shape, for benchmarks and tests.

The tokenizer is byte-level: any text encodes (one token per UTF-8 byte), and the rest of the vocabulary is
filled with ``<|reserved_N|>`` tokens so that every id the model can emit decodes to something.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from gpt_fast.convert.writer import check_checkpoint_output, write_checkpoint
from gpt_fast.model.config import CheckpointConfig, ModelConfig, TokenizerConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import weight_shapes
from gpt_fast.text.tokenizer import bytes_to_unicode
from gpt_fast.util.device import dtype_name, resolve_dtype

TOKENIZER_FILE = "tokenizer.json"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
INIT_STD = 0.02


def byte_tokenizer(vocab_size: int) -> tuple[Tokenizer, TokenizerConfig]:
    """A byte-level tokenizer with exactly ``vocab_size`` ids: bytes 0-255 (id = byte value), BOS, EOS, then
    reserved tokens."""
    if vocab_size < 258:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= 258, got {vocab_size}")
    byte_chars = bytes_to_unicode()
    names = [byte_chars[b] for b in range(256)] + [BOS, EOS] + [f"<|reserved_{i}|>" for i in range(vocab_size - 258)]
    tokenizer = Tokenizer(models.BPE(vocab={name: i for i, name in enumerate(names)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    config = TokenizerConfig(
        kind="huggingface",
        file=TOKENIZER_FILE,
        bos_id=256,
        add_bos=True,
        stop_ids=(257,),
        bos_token=BOS,
        eos_token=EOS,
        special_tokens={BOS: 256, EOS: 257},
    )
    return tokenizer, config


def random_weights(
    model: ModelConfig, dtype: torch.dtype, seed: int, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Weights drawn from N(0, 0.02²) (norms scale by 1), identical for the same shape, dtype, seed and device
    type."""
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in weight_shapes(model).items():
        if name.endswith("norm.weight"):
            tensor = torch.full(shape, 1.0 - model.norm_offset, dtype=dtype)
        else:
            tensor = (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * INIT_STD).to(dtype)
        state[name] = tensor.cpu()
    return state


def make_random_checkpoint(
    model: ModelConfig,
    out_dir: Path,
    *,
    dtype: torch.dtype,
    seed: int = 0,
    device: str | torch.device = "cpu",
    source: str = "random",
) -> Path:
    """Write a random-weight checkpoint of shape ``model`` into ``out_dir``; return the weights path."""
    check_checkpoint_output(out_dir)
    tokenizer, tok_config = byte_tokenizer(model.vocab_size)
    config = CheckpointConfig(
        model=model,
        tokenizer=tok_config,
        dtype=dtype_name(dtype),
        source={"kind": "random", "shape": source, "seed": seed},
    )

    def prepare(stage: Path) -> CheckpointConfig:
        tokenizer.save(str(stage / TOKENIZER_FILE))
        return config

    write_checkpoint(out_dir, random_weights(model, dtype, seed, device), prepare)
    return out_dir / config.weights


def random_shape_folder(shape: str, output_dir: Path, device: torch.device) -> Path:
    """``output_dir/shape``, a random-weight checkpoint of the named shape in the device's default dtype, written
    there the first time and reused after (what the scripts that time a shape run on)."""
    folder = output_dir / shape
    if not (folder / "model.pth").exists():
        make_random_checkpoint(get_shape(shape), folder, dtype=resolve_dtype("auto", device), device=device)
    return folder
