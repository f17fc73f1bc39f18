"""Hugging Face checkpoint folder -> gpt-fast checkpoint.

Every shard's names and shapes are checked against config.json before any tensor is loaded; tensors are then
converted shard by shard.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from gpt_fast.checkpoint.load import check_tokenizer_size
from gpt_fast.convert.hf_config import NUMBER, architecture, architecture_name, model_config_from_hf
from gpt_fast.convert.hf_config import _field as hf_field
from gpt_fast.convert.hf_tokenizer import tokenizer_from_hf_dir
from gpt_fast.convert.layout import check_tensors, fuse_tensors, max_source_tensors, naming, source_dtype
from gpt_fast.convert.weight_files import iter_tensors, tensor_infos, weight_files
from gpt_fast.convert.writer import check_checkpoint_output, target_dir, write_checkpoint
from gpt_fast.model.config import CheckpointConfig, GenerationDefaults, QuantConfig
from gpt_fast.quant.layout import quantize_state
from gpt_fast.text.tokenizer import load_tokenizer
from gpt_fast.util.device import dtype_name, parse_dtype
from gpt_fast.util.fileio import read_json_object, regular_file

GENERATION_CONFIG = "generation_config.json"


def generation_defaults(path: Path) -> GenerationDefaults | None:
    """The sampling ``generation_config.json`` recommends (temperature, top_k, top_p, each where present, as vLLM
    takes them; ``do_sample`` is not read: a recommendation of values is one to sample with them); None without
    the file or any of them."""
    if not path.exists():
        return None
    data = read_json_object(regular_file(path, "generation config"))
    values = {
        "temperature": hf_field(data, "temperature", str(path), NUMBER, None),
        "top_k": hf_field(data, "top_k", str(path), NUMBER, None),
        "top_p": hf_field(data, "top_p", str(path), NUMBER, None),
    }
    given = {name: value for name, value in values.items() if value is not None}
    if not given:
        return None
    if "top_k" in given and given["top_k"] != int(given["top_k"]):
        raise ValueError(f"{path}: field top_k has the wrong type ({given['top_k']!r}; it must be an integer)")
    if "top_k" in given:
        given["top_k"] = max(int(given["top_k"]), 0)  # 0 or negative: no top-k filter
    try:
        return GenerationDefaults(**given, source=GENERATION_CONFIG)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def convert_hf(src: Path, out_dir: Path, dtype: str | None = None, quantization: QuantConfig | None = None) -> Path:
    """Convert the HF folder ``src`` into ``out_dir`` (quantized with ``quantization``); return the path of the
    written ``model.pth``."""
    if not src.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {src}")
    if target_dir(out_dir) == src.resolve():
        raise ValueError(f"the output folder must differ from the source folder {src} (both hold a config.json)")
    check_checkpoint_output(out_dir)
    hf_config = read_json_object(src / "config.json")
    where = str(src / "config.json")
    model = model_config_from_hf(hf_config, where)
    tok_config, tok_files, chat_template = tokenizer_from_hf_dir(src, hf_config)
    folder = tok_files[0].parent  # tok_config.file is the name of the first file, here in its source folder
    check_tokenizer_size(load_tokenizer(folder, tok_config).vocab_size, model, str(folder / tok_config.file))
    names = naming(architecture_name(hf_config, where))
    files = weight_files(src)
    max_tensors = max_source_tensors(model, names)
    infos = tensor_infos(files, max_tensors)
    check_tensors(infos, model, src, names)
    target = parse_dtype(dtype) if dtype else source_dtype(infos)
    generation = generation_defaults(src / GENERATION_CONFIG)
    try:
        config = CheckpointConfig(
            model=model,
            tokenizer=tok_config,
            dtype=dtype_name(target),
            chat_template=chat_template,
            source={"kind": "huggingface", "path": str(src), "architecture": architecture(hf_config, where)},
            quantization=quantization,
            generation=generation,
        )
    except ValueError as err:  # a token id outside the vocabulary, a model the quantization does not fit
        raise ValueError(f"{src}: {err}") from None
    tensors = (item for path in files for item in iter_tensors(path, max_tensors))
    state = fuse_tensors(tensors, model, target, src, names)
    if quantization is not None:
        state = quantize_state(state, model, quantization, target)

    def prepare(stage: Path) -> CheckpointConfig:
        for path in tok_files:
            shutil.copyfile(path, stage / path.name)
        return config

    write_checkpoint(out_dir, state, prepare)
    return out_dir / config.weights
