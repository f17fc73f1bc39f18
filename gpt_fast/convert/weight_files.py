"""Finding, checking and reading the weight files of a Hugging Face checkpoint folder.

Only safetensors and ``torch.load(weights_only=True)`` are used: a pickle that tries to build anything but
tensors is refused before it can run.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gpt_fast.checkpoint import load_torch_weights

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


def weight_files(src: Path) -> list[Path]:
    """The folder's weight files: the shards an index lists (all must exist), or the single file."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = src / index_name
        if index.is_file():
            return shards_from_index(index)
    for single in (SAFETENSORS_SINGLE, BIN_SINGLE):
        if (src / single).is_file():
            return [src / single]
    raise FileNotFoundError(
        f"no weights in {src} (looked for {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, {BIN_INDEX}, {BIN_SINGLE})"
    )


def shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{index} is not a valid shard index ({type(err).__name__}: {err})") from None
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
    return [index.parent / n for n in names]


def safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Read a safetensors header and check that the file is exactly as long as the header says."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise ValueError(f"{path}: truncated safetensors file (header of {header_len} bytes, file of {size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: corrupt safetensors header ({err})") from None
    header.pop("__metadata__", None)
    end = 8 + header_len + max((t["data_offsets"][1] for t in header.values()), default=0)
    if size < end:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, the header describes {end})")
    if size > end:
        raise ValueError(f"{path}: {size - end} extra bytes after the safetensors payload")
    infos = {}
    for name, t in header.items():
        if t["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {t['dtype']}")
        infos[name] = TensorInfo(tuple(t["shape"]), SAFETENSORS_DTYPES[t["dtype"]], path)
    return infos


def tensor_infos(files: list[Path]) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of every tensor in ``files``, read without loading the data."""
    infos: dict[str, TensorInfo] = {}
    for path in files:
        if path.suffix == ".safetensors":
            found = safetensors_header(path)
        else:
            found = {name: TensorInfo(tuple(t.shape), t.dtype, path) for name, t in load_torch_weights(path).items()}
        for name in found.keys() & infos.keys():
            raise ValueError(f"tensor {name} appears in both {infos[name].file.name} and {path.name}")
        infos.update(found)
    return infos


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one weight file, one at a time."""
    if path.suffix != ".safetensors":
        yield from load_torch_weights(path).items()
        return
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except SafetensorError as err:
        raise ValueError(f"{path}: {err}") from None
