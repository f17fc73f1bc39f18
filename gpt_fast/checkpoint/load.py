"""Loading a converted checkpoint (``model.pth`` + ``config.json``) into a :class:`Transformer`, and the checks
every weights file goes through (the converters' inputs too).

A ``torch.save`` file is a zip archive: a pickle naming the tensors (their dtype, shape and storage) and one
record of raw bytes per storage. Everything that can be checked without the data is checked first, from the
zip directory and the pickle alone (the records are memory-mapped, not read), so a file that does not match its
config, or whose tensors would view more bytes than they hold, is refused before anything is allocated.
"""

from __future__ import annotations

import functools
import mmap
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gpt_fast.model.config import CONFIG_FILE, CheckpointConfig, ModelConfig, QuantConfig, load_checkpoint_config
from gpt_fast.model.transformer import Transformer, weight_count
from gpt_fast.parallel.tensor_parallel import Shard
from gpt_fast.quant.layers import prepare_quantized, quantize_linears
from gpt_fast.quant.layout import quantized_dtypes, stored_size, stored_specs
from gpt_fast.text.tokenizer import Tokenizer, load_tokenizer
from gpt_fast.util.device import DTYPES
from gpt_fast.util.fileio import first_line, inside_folder, regular_file

Shape = tuple[int, ...]
SOURCE_DTYPES = (*DTYPES.values(), torch.float64)  # what a weights file may hold (float64 only as a source)
# The pickle of a torch.save archive is read by torch's pure-Python weights-only unpickler, slowly (about 1 ms
# per tensor): it may hold at most this many bytes per tensor its config describes (ours use about 150).
PICKLE_BYTES_PER_TENSOR = 1024
PICKLE_BYTES_MIN = 64 << 10
LOCAL_HEADER_SIZE = 30  # a zip member's local header before its name and extra field
CRC_THREADS = 4


def check_shapes(found: Mapping[str, Shape], expected: Mapping[str, Shape], where: str) -> None:
    """Raise ValueError listing every missing and unexpected tensor name, then the first shape that disagrees."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensor(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s): {_listing(unexpected)}")
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise ValueError(f"{where}: tensor {name} has shape {list(found[name])}, config.json expects {list(shape)}")


def _listing(names: list[str], most: int = 20) -> str:
    """Names separated by commas, at most ``most`` of them (the error stays one readable line)."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def check_tensor_count(found: int, expected: int, config: ModelConfig, where: str) -> None:
    """Refuse, before any per-tensor work, a config that describes more tensors than the weights hold (a config
    claiming millions of layers fails here, in microseconds)."""
    if found < expected:
        raise ValueError(f"{where} holds {found} tensors, a model of {config.n_layer} layers (n_layer) has {expected}")


def check_tokenizer_size(tokens: int, config: ModelConfig, where: str) -> None:
    """Every id the tokenizer can produce must have a row in the embedding table."""
    if tokens > config.vocab_size:
        raise ValueError(
            f"{where}: the tokenizer has {tokens} tokens, more than the model's embedding table "
            f"(model.vocab_size = {config.vocab_size})"
        )


def _archive_members(path: Path) -> list[zipfile.ZipInfo]:
    """The members of a ``torch.save`` zip archive, from its directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a torch.save archive (a zip file): {first_line(err)}") from None


def _archive_records(path: Path, members: list[zipfile.ZipInfo], max_tensors: int) -> list[int]:
    """Check a ``torch.save`` zip archive from its directory alone; return the sizes of its data records."""
    pickles = [m for m in members if m.filename.partition("/")[2] == "data.pkl"]
    if len(pickles) != 1:
        raise ValueError(f"{path} is not a torch.save archive: it holds {len(pickles)} data.pkl, not 1")
    compressed = [m.filename for m in members if m.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise ValueError(f"{path}: archive member {compressed[0]} is compressed (torch.save stores its data as is)")
    if sum(m.file_size for m in members) > path.stat().st_size:
        raise ValueError(f"{path}: the zip directory claims more bytes than the file holds")
    limit = max(PICKLE_BYTES_MIN, PICKLE_BYTES_PER_TENSOR * max_tensors)
    if pickles[0].file_size > limit:
        raise ValueError(
            f"{path}: its pickle of {pickles[0].file_size} bytes is too large for at most {max_tensors} tensors"
        )
    records = [m.file_size for m in members if m.filename.partition("/")[2].startswith("data/")]
    if len(records) > max_tensors:
        raise ValueError(f"{path} holds {len(records)} data records, more than the {max_tensors} tensors expected")
    return records


def _check_state(
    state: object, records: list[int], path: Path, dtypes: tuple[torch.dtype, ...]
) -> dict[str, torch.Tensor]:
    """A dict of tensors of ``dtypes`` whose storages are exactly the archive's records, none viewing bytes that
    no tensor holds."""
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a dict of tensors")
    storages: dict[int, int] = {}  # data pointer -> size: the distinct storages, memory-mapped
    held = 0
    for name, tensor in state.items():
        if not isinstance(name, str):
            raise ValueError(f"{path}: tensor name {name!r} is not a string")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{path}: {name} is a {type(tensor).__name__}, not a tensor")
        if tensor.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{path}: tensor {name} has dtype {tensor.dtype}; weights must be one of {allowed}")
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
        held += tensor.numel() * tensor.element_size()
    if sorted(storages.values()) != sorted(size for size in records if size):
        raise ValueError(f"{path}: its tensors' storages do not match the archive's data records (corrupt file)")
    if sum(storages.values()) > held:
        raise ValueError(
            f"{path}: its tensors view {sum(storages.values())} bytes of storage but hold only {held} (hidden data)"
        )
    return state


def _unpickler_reason(err: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only error that says what was refused (it comes amid lines of advice)."""
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return next((line for line in lines if not line.startswith(advice)), first_line(err))


def load_torch_weights(
    path: Path, max_tensors: int, dtypes: tuple[torch.dtype, ...] = SOURCE_DTYPES
) -> dict[str, torch.Tensor]:
    """A ``torch.save``'d dict of at most ``max_tensors`` tensors of ``dtypes`` (floating point unless told),
    memory-mapped (nothing is read until used), read with ``weights_only=True`` (a pickle that would build anything
    but tensors is refused before it runs) after the archive's directory has been checked."""
    if not path.exists():
        raise FileNotFoundError(f"missing weights file {path}")
    regular_file(path, "weights file")
    members = _archive_members(path)
    records = _archive_records(path, members, max_tensors)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path}: unsafe pickle refused, it holds more than tensors ({_unpickler_reason(err)})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError, KeyError, IndexError) as err:
        raise ValueError(f"{path} is not a readable weights file: {first_line(err)}") from None
    state = _check_state(state, records, path, dtypes)
    check_crcs(path, members)
    return state


def check_crcs(path: Path, members: list[zipfile.ZipInfo]) -> None:
    """Refuse an archive any of whose members' bytes differ from the CRC-32 its directory records (a flipped bit
    in a weight loads silently otherwise): one pass over the file through a memory map, the members spread over
    threads (``zlib.crc32`` releases the GIL). On the default model's 538 MB file this costs 0.3 s of CPU (docs/
    bad_inputs.md, "What the checks cost")."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        view = memoryview(data)
        try:
            with ThreadPoolExecutor(max_workers=min(CRC_THREADS, os.cpu_count() or 1)) as pool:
                checked = pool.map(functools.partial(_crc_ok, view), members)
                bad = [member for member, ok in zip(members, checked, strict=True) if not ok]
        finally:
            view.release()
    if bad:
        raise ValueError(f"{path}: archive member {bad[0].filename} fails its CRC-32 check (the file is corrupt)")


def _crc_ok(view: memoryview, member: zipfile.ZipInfo) -> bool:
    """Whether ``member``'s stored bytes in the archive ``view`` match its directory's CRC-32 (and lie inside it)."""
    header = bytes(view[member.header_offset : member.header_offset + LOCAL_HEADER_SIZE])
    if len(header) < LOCAL_HEADER_SIZE or not header.startswith(b"PK\x03\x04"):
        return False
    name_length, extra_length = struct.unpack_from("<HH", header, 26)
    start = member.header_offset + LOCAL_HEADER_SIZE + name_length + extra_length
    if start + member.compress_size > len(view):
        return False
    with view[start : start + member.compress_size] as stored:
        return zlib.crc32(stored) == member.CRC


def check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse NaN and infinite weights: each tensor's minimum and maximum (NaN propagates to both), one pass
    over the data on the tensors' device (as fast as a sum, where ``isfinite(t).all()`` is many times slower on
    a CPU), and one synchronization."""
    names = [name for name, t in tensors.items() if t.numel()]
    if not names:
        return
    bounds = torch.stack([torch.stack(tensors[name].aminmax()).float() for name in names])  # [N, 2]
    finite = bounds.isfinite().all(dim=1).tolist()
    bad = next((name for name, ok in zip(names, finite, strict=True) if not ok), None)
    if bad is not None:
        dtype = str(tensors[bad].dtype).removeprefix("torch.")
        raise ValueError(f"{where}: tensor {bad} holds NaN or infinite values (in {dtype})")


def checkpoint_weights(path: Path, config: CheckpointConfig) -> dict[str, torch.Tensor]:
    """The weights file ``path`` of a converted checkpoint, memory-mapped and checked against ``config`` (size,
    tensor count, names, shapes, dtypes, quantized tensors included) before any data is read."""
    dtype, quant = DTYPES[config.dtype], config.quantization
    tensors, needed = stored_size(config.model, quant, dtype)
    if path.is_file() and path.stat().st_size < needed:
        scheme = "" if quant is None else f", quantized {quant.name}"
        raise ValueError(
            f"{path} holds {path.stat().st_size} bytes, config.json's model describes "
            f"{weight_count(config.model)[1]} parameters ({needed} bytes in {config.dtype}{scheme})"
        )
    allowed = SOURCE_DTYPES if quant is None else (*SOURCE_DTYPES, *quantized_dtypes(quant))
    state = load_torch_weights(path, tensors, allowed)
    check_tensor_count(len(state), tensors, config.model, str(path))
    specs = stored_specs(config.model, quant, dtype)
    check_shapes({name: tuple(t.shape) for name, t in state.items()}, {n: s for n, (s, _) in specs.items()}, str(path))
    for name, tensor in state.items():
        if tensor.dtype != specs[name][1]:
            expected = "the quantized dtype" if specs[name][1] != dtype else "dtype"
            wanted = str(specs[name][1]).removeprefix("torch.")
            raise ValueError(f"{path}: tensor {name} is {tensor.dtype}, config.json says {expected} {wanted}")
    return state


def load_model(
    checkpoint_dir: Path,
    config: CheckpointConfig,
    device: torch.device,
    dtype: torch.dtype,
    kernel: str = "auto",
    shard: Shard | None = None,
) -> Transformer:
    """Build the model ``config`` describes and load its weights file onto ``device`` in ``dtype`` (quantized
    layers computing with ``kernel``); NaN or infinite weights (also those made by converting to ``dtype``) are
    refused. With ``shard``, only that rank's part of the model, sliced out of the memory-mapped file."""
    path = inside_folder(checkpoint_dir, config.weights, f"{checkpoint_dir / CONFIG_FILE}: weights")
    state = checkpoint_weights(path, config)
    if device.type == "cpu":
        # On the CPU, computing from a private file mapping is 8x slower than from ordinary memory (SmolLM2-135M
        # decode), and copying out of the mapping page by page 4x slower than reading the file again: once checked,
        # the file is read in whole.
        state = torch.load(path, map_location="cpu", weights_only=True)
    if shard is not None:
        state = shard.slice_state(state, config.model)
    model = model_from_state(config.model, state, device, dtype, config.quantization, kernel, shard)
    check_finite(dict(model.named_parameters()), str(path))
    return model


def check_checkpoint(checkpoint_dir: Path) -> CheckpointConfig:
    """Read a checkpoint folder as `generate` does, short of building the model: its config, its tokenizer, and its
    weights' names and shapes (memory-mapped, nothing copied); raise what loading it would raise. The converter
    runs this on its staged result, so every check added to loading also guards what is written."""
    config = load_checkpoint_config(checkpoint_dir)
    checkpoint_tokenizer(checkpoint_dir, config)
    weights = inside_folder(checkpoint_dir, config.weights, f"{checkpoint_dir / CONFIG_FILE}: weights")
    checkpoint_weights(weights, config)
    return config


def checkpoint_tokenizer(checkpoint_dir: Path, config: CheckpointConfig) -> Tokenizer:
    """The tokenizer ``config`` names, refused if it can produce ids beyond the model's embedding table."""
    tokenizer = load_tokenizer(checkpoint_dir, config.tokenizer)
    check_tokenizer_size(tokenizer.vocab_size, config.model, str(checkpoint_dir / config.tokenizer.file))
    return tokenizer


def model_from_state(
    config: ModelConfig,
    state: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    quantization: QuantConfig | None = None,
    kernel: str = "auto",
    shard: Shard | None = None,
) -> Transformer:
    """The model for ``config`` holding ``state``'s tensors (no copy where they already have ``device`` and ``dtype``),
    ready for inference; with ``quantization``, its quantized layers compute with ``kernel``. With ``shard``, ``state``
    is a rank's (:meth:`~gpt_fast.parallel.tensor_parallel.Shard.slice_state`) and the model that rank's part, without
    its collectives (:meth:`gpt_fast.parallel.tensor_parallel.TensorParallel.connect`)."""
    local = config if shard is None else shard.local_config(config)
    with torch.device("meta"):
        model = Transformer(local)
        if quantization is not None:
            quantize_linears(model, local, quantization)
        if shard is not None:
            shard.prepare(model, config, quantization)
    model.load_state_dict(state, assign=True)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if quantization is not None:
        prepare_quantized(model, device, kernel)
    return model
