"""A bounded first pass over a GGUF file's header, before the ``gguf`` library reads it.

``GGUFReader`` walks the header in Python, building numpy views of every metadata value and of every element
of every array (tens of microseconds each), recursing into arrays of arrays, and trusting every count and
length it reads. A crafted header (2**60 tensors, an array of a billion elements, arrays nested a thousand deep,
a token of a million characters, a tensor lying past the end of the file) would make it, or the tokenizer
conversion after it, loop, allocate or recurse without bound. This pass reads the same header with ``struct``,
checks every count and length against the limits below and against the file's size, and keeps nothing: its
time is linear in the header, and what the library then does is bounded by the limits.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # those GGUFReader reads
MAX_TENSORS = 1 << 16  # Llama 3.1 405B has 1138
MAX_KEYS = 1 << 16  # metadata entries; real files have about 40
MAX_NAME = 1 << 10  # bytes of a key or a tensor name (llama.cpp allows 64 for tensor names)
MAX_STRING = 1 << 20  # bytes of a metadata string (the largest are chat templates, tens of kilobytes)
MAX_ARRAY = 1 << 20  # elements of an array (the largest vocabularies have 262144 tokens)
MAX_ELEMENTS = 1 << 21  # elements of all arrays together (tokens, their scores and types, merges: about 1M at most)
MAX_ARRAY_STRING = 1 << 12  # bytes of a string inside an array: a token or a merge (real ones are < 300)
MAX_DIMS = 4  # llama.cpp's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class _Cursor:
    """Reads the header front to back, refusing any read past the end of the file."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.pos, self.order = data, path, 0, "<"
        self.elements = 0  # array elements read so far

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path} is not a readable GGUF file: {message}")

    def skip(self, size: int, what: str) -> None:
        if self.pos + size > len(self.data):
            raise self.error(f"truncated at the {what} (offset {self.pos}, {size} bytes past the end of the file)")
        self.pos += size

    def read(self, fmt: str, what: str) -> int | float | bool:
        start = self.pos
        self.skip(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.data, start)[0]

    def string(self, limit: int, what: str) -> bytes:
        length = self.read("Q", what)
        if length > limit:
            raise self.error(f"{what} is {length} bytes long (at most {limit})")
        start = self.pos
        self.skip(length, what)
        return self.data[start : self.pos]

    def count(self, limit: int, what: str) -> int:
        value = self.read("Q", what)
        if value > limit:
            raise self.error(f"{what} is {value} (at most {limit})")
        return value


def _value_type(raw: int, cursor: _Cursor, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cursor.error(f"{what} has unknown type {raw}") from None


def _skip_value(cursor: _Cursor, kind: GGUFValueType, key: str) -> None:
    if kind in SCALAR_FORMATS:
        cursor.skip(struct.calcsize(SCALAR_FORMATS[kind]), f"value of {key}")
    elif kind == GGUFValueType.STRING:
        cursor.string(MAX_STRING, f"string {key}")
    else:
        item = _value_type(cursor.read("I", f"array {key}"), cursor, f"array {key}")
        length = cursor.count(MAX_ARRAY, f"the length of array {key}")
        cursor.elements += length
        if cursor.elements > MAX_ELEMENTS:
            raise cursor.error(f"array {key} brings the metadata's array elements past {MAX_ELEMENTS}")
        if item == GGUFValueType.ARRAY:
            raise cursor.error(f"array {key} holds arrays (nested arrays are not supported)")
        if item == GGUFValueType.STRING:
            for index in range(length):
                cursor.string(MAX_ARRAY_STRING, f"{key}[{index}]")
        else:
            cursor.skip(length * struct.calcsize(SCALAR_FORMATS[item]), f"array {key}")


def _tensor_extent(cursor: _Cursor) -> tuple[str, int, int]:
    """One tensor's entry: ``(name, offset, bytes)``, its data's place after the header."""
    name = cursor.string(MAX_NAME, "a tensor name").decode("utf-8", errors="replace")
    n_dims = cursor.read("I", f"tensor {name}")
    if n_dims > MAX_DIMS:
        raise cursor.error(f"tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})")
    dims = [cursor.read("Q", f"tensor {name}") for _ in range(n_dims)]
    raw_type = cursor.read("I", f"tensor {name}")
    offset = cursor.read("Q", f"tensor {name}")
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
    except (ValueError, KeyError):
        raise cursor.error(f"tensor {name} has unknown type {raw_type}") from None
    if dims and dims[0] % block:
        raise cursor.error(f"tensor {name}: rows of {dims[0]} values do not fill blocks of {block}")
    return name, offset, math.prod(dims) // block * block_bytes


def check_gguf_header(path: Path) -> None:
    """Check that ``path``'s GGUF header stays within the limits above and its tensors within the file;
    a one-line ValueError naming the file and the field otherwise."""
    with path.open("rb") as f:
        if path.stat().st_size < 24:
            raise ValueError(f"{path} is not a readable GGUF file: truncated ({path.stat().st_size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _check(_Cursor(data, path))


def _check(cursor: _Cursor) -> None:
    if cursor.data[:4] != GGUF_MAGIC:
        raise cursor.error("no GGUF magic")
    cursor.skip(4, "magic")
    version = cursor.read("I", "version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order, as GGUFReader reads it
        cursor.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in SUPPORTED_VERSIONS:
        raise cursor.error(f"version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    tensor_count = cursor.count(MAX_TENSORS, "the tensor count")
    key_count = cursor.count(MAX_KEYS, "the metadata count")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(key_count):
        key = cursor.string(MAX_NAME, "a metadata key").decode("utf-8", errors="replace")
        kind = _value_type(cursor.read("I", f"metadata {key}"), cursor, f"metadata {key}")
        if key == "general.alignment" and kind == GGUFValueType.UINT32:
            alignment = cursor.read("I", key)
        else:
            _skip_value(cursor, kind, key)
    if alignment <= 0 or alignment & (alignment - 1):
        raise cursor.error(f"general.alignment {alignment} is not a power of two")
    extents = [_tensor_extent(cursor) for _ in range(tensor_count)]
    data_start = -(-cursor.pos // alignment) * alignment
    for name, offset, size in extents:
        if data_start + offset + size > len(cursor.data):
            raise cursor.error(f"tensor {name} lies past the end of the file (truncated)")
