"""Finding, checking and reading the weight files of a Hugging Face checkpoint folder.

Only safetensors and ``torch.load(weights_only=True)`` are used: a pickle that tries to build anything but
tensors is refused before it can run. Every file's header (names, dtypes, shapes, where the bytes lie) is checked
for shape and against the file's size before any tensor is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from gpt_fast.checkpoint.load import load_torch_weights
from gpt_fast.util.fileio import first_line, inside_folder, read_json_object, regular_file

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SAFETENSORS_MAX_HEADER = 100_000_000  # bytes; the safetensors library's own limit
TENSOR_FIELDS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


def weight_files(src: Path) -> list[Path]:
    """The folder's weight files: the shards an index lists (all must exist), or the single file."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = src / index_name
        if os.path.lexists(index):  # a link that leads nowhere is named, not skipped
            return shards_from_index(index)
    for single in (SAFETENSORS_SINGLE, BIN_SINGLE):
        if os.path.lexists(src / single):
            return [regular_file(src / single, "weights file")]
    raise FileNotFoundError(
        f"no weights in {src} (looked for {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, {BIN_INDEX}, {BIN_SINGLE})"
    )


def shards_from_index(index: Path) -> list[Path]:
    """The shard files a ``*.index.json`` names in its ``weight_map`` (tensor name -> file name), each a regular
    file inside the index's folder."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must be an object of tensor name -> shard file name")
    shards = [inside_folder(index.parent, name, f"{index}: weight_map") for name in sorted(set(weight_map.values()))]
    missing = [path.name for path in shards if not path.exists()]
    if missing:
        raise FileNotFoundError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
    return [regular_file(path, "shard") for path in shards]


def _header_json(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header object and the size of the data that follows it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise ValueError(f"{path}: safetensors header of {header_len} bytes in a file of {size} bytes")
        try:
            header = json.loads(f.read(header_len))
        except RecursionError:
            raise ValueError(f"{path}: corrupt safetensors header (nested too deeply)") from None
        except ValueError as err:  # also UnicodeDecodeError
            raise ValueError(f"{path}: corrupt safetensors header ({first_line(err)})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header must be a JSON object, not a {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: safetensors __metadata__ must be an object of strings")
    return header, size - 8 - header_len


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entry(name: str, entry: Any, path: Path) -> tuple[TensorInfo, int, int]:
    """One header entry checked for shape: ``(info, begin, end)``, its bytes at ``[begin, end)`` of the data."""
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict) or set(entry) != TENSOR_FIELDS:
        raise ValueError(f"{where} must be an object with exactly the fields {', '.join(sorted(TENSOR_FIELDS))}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"{where} has unsupported dtype {dtype!r} (supported: {', '.join(SAFETENSORS_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)):
        raise ValueError(f"{where}: data_offsets must be two non-negative integers, got {offsets!r}")
    begin, end = offsets
    nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise ValueError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes, its {dtype} {shape} needs {nbytes}"
        )
    return TensorInfo(tuple(shape), SAFETENSORS_DTYPES[dtype], path), begin, end


def safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Read a safetensors header; check every entry, and that the tensors' bytes tile the data exactly."""
    header, data_size = _header_json(path)
    entries = {name: _tensor_entry(name, entry, path) for name, entry in header.items()}
    position = 0
    for name, (_, begin, end) in sorted(entries.items(), key=lambda item: item[1][1:]):
        if begin != position:
            problem = "overlaps the one before" if begin < position else f"leaves bytes {position}-{begin} unused"
            raise ValueError(f"{path}: tensor {name} {problem}")
        position = end
    if position > data_size:
        raise ValueError(
            f"{path}: truncated safetensors file (the header describes {position} bytes of data, "
            f"the file holds {data_size})"
        )
    if position < data_size:
        raise ValueError(f"{path}: {data_size - position} extra bytes after the safetensors payload")
    return {name: info for name, (info, _, _) in entries.items()}


def tensor_infos(files: list[Path], max_tensors: int) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of every tensor in ``files``, read without loading the data; a pickled
    (``.bin``) file may hold at most ``max_tensors`` tensors."""
    infos: dict[str, TensorInfo] = {}
    for path in files:
        if path.suffix == ".safetensors":
            found = safetensors_header(path)
        else:
            found = {
                name: TensorInfo(tuple(t.shape), t.dtype, path)
                for name, t in load_torch_weights(path, max_tensors).items()
            }
        for name in found.keys() & infos.keys():
            raise ValueError(f"tensor {name} appears in both {infos[name].file.name} and {path.name}")
        infos.update(found)
    return infos


def iter_tensors(path: Path, max_tensors: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one weight file, one at a time."""
    if path.suffix != ".safetensors":
        yield from load_torch_weights(path, max_tensors).items()
        return
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (SafetensorError, RuntimeError) as err:  # RuntimeError: the file cannot be memory-mapped
        raise ValueError(f"{path}: {first_line(err)}") from None
