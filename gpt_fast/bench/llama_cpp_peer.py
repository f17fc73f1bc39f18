"""llama.cpp's rows of `gpt-fast bench decode` on the CPU, through ``llama-cpp-python`` (an optional dependency,
used only when importable): the default model's GGUF as it ships (Q4_1 layers, a Q8_0 embedding table that is also
the output projection) and that file requantized by llama.cpp's own ``llama_model_quantize`` to Q8_0 and to F16
(made once, then kept in the per-user cache). They run when ``--shape`` is the default model's shape
(``smollm2-135m``), on the CPU, with as many threads as torch uses for our rows.

Timed as our rows are (:func:`gpt_fast.bench.decode.measure_build`): a warm-up run, then ``--repeats`` timed runs of
the same prompt token ids and ``--new_tokens`` new tokens, tok/s their median; TTFT the median of three one-token
runs of the long prompt. A run clears the context's KV cache, decodes the prompt in one batch, then samples a token
and decodes it, until it has ``--new_tokens`` of them, never stopping at an end-of-text token: greedy (llama.cpp's
greedy sampler) with ``--greedy``, else top-k, temperature and a seeded draw, as our rows sample. The sampler and
the Python loop around ``llama_decode`` run inside the timed span, as our rows' sampling and loop do."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gpt_fast.convert.default_model import default_gguf
from gpt_fast.generation.options import SamplingConfig
from gpt_fast.model.config import ModelConfig
from gpt_fast.util.fileio import atomic_path
from gpt_fast.util.paths import user_cache_dir

DEFAULT_SHAPE = "smollm2-135m"  # the default model's shape (gguf_matches checks its GGUF against it)
FORMS = ("Q4_1", "Q8_0", "F16")  # the shipped file's own form first
FILE_TYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "F16": "LLAMA_FTYPE_MOSTLY_F16"}  # llama_cpp's ftype constants
CACHE_SUBDIR = "llama.cpp"  # in the per-user cache: the requantized files
SEED = 0  # the draws of sampled (not greedy) runs

Run = Callable[[list[int], int], None]  # generate (prompt ids, new tokens), as gpt_fast.bench.decode's


def llama_cpp_version() -> str | None:
    """``llama-cpp-python``'s version when it is importable, else None (its rows are then skipped)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from importlib.metadata import version

    return version("llama-cpp-python")


def gguf_matches(path: Path, shape: ModelConfig) -> bool:
    """Whether the GGUF at ``path`` is a model of ``shape`` (its norm epsilon compared as the float32 it is)."""
    from gpt_fast.convert.gguf_file import model_config_from_gguf, open_gguf

    config = model_config_from_gguf(open_gguf(path))
    same_eps = math.isclose(config.norm_eps, shape.norm_eps, rel_tol=1e-6)
    return same_eps and dataclasses.replace(config, norm_eps=shape.norm_eps) == shape


def form_name(form: str, stem: str) -> str:
    """``SmolLM2-135M-Instruct.Q4_1`` and ``Q8_0`` -> ``SmolLM2-135M-Instruct.Q8_0.gguf``."""
    return f"{stem.rsplit('.', 1)[0]}.{form}.gguf"


def requantized(source: Path, form: str, cache_dir: Path, threads: int) -> Path:
    """``source`` requantized by llama.cpp to ``form`` (a key of :data:`FILE_TYPES`), in ``cache_dir``: made once,
    written under an unpredictable temporary name and renamed into place, so a reader never sees a partial file.
    Raises RuntimeError, naming the form, when llama.cpp cannot make it."""
    import llama_cpp

    dest = cache_dir / form_name(form, source.stem)
    if dest.is_file():
        return dest
    quiet()
    cache_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FILE_TYPES[form])
    params.allow_requantize = True  # the source's layers are quantized already
    params.nthread = threads
    with atomic_path(dest) as tmp:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if status != 0:
            raise RuntimeError(f"llama_model_quantize could not make {form} from {source} (status {status})")
    return dest


def quiet() -> None:
    """Only llama.cpp's errors on standard error: its loader and quantizer log every tensor."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)


def gguf_bytes_per_token(path: Path) -> int:
    """The weight bytes a decode step reads from the GGUF at ``path``, counted as
    :func:`gpt_fast.model.transformer.weight_bytes_per_token` counts ours: every tensor but an embedding table that
    is not the output projection (one row of it is read)."""
    from gpt_fast.convert.gguf_file import open_gguf

    tensors = {t.name: int(t.n_bytes) for t in open_gguf(path).tensors}
    untied_table = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
    return sum(tensors.values()) - untied_table


def gguf_types(path: Path) -> str:
    """The GGUF's two-dimensional tensors' types, most common first: ``Q8_0 ×211`` (norms, F32, left out)."""
    from collections import Counter

    from gpt_fast.convert.gguf_file import open_gguf

    counts = Counter(t.tensor_type.name for t in open_gguf(path).tensors if len(t.shape) > 1)
    return ", ".join(f"{name} ×{count}" for name, count in counts.most_common())


def sampler(llama_cpp: Any, sampling: SamplingConfig) -> Any:
    """llama.cpp's sampler chain for ``sampling``: greedy, or top-k, top-p (when it filters), temperature and a
    seeded draw."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if sampling.greedy:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    if sampling.top_k is not None:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(sampling.top_k))
    if sampling.nucleus:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(sampling.temperature))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(SEED))
    return chain


class LlamaCppDecoder:
    """One GGUF loaded by llama.cpp with a context of ``context_tokens`` (the prompt decoded in one batch), decoding
    on ``threads`` threads; freed when it is no longer referenced."""

    def __init__(self, path: Path, threads: int, context_tokens: int, sampling: SamplingConfig) -> None:
        import llama_cpp

        quiet()
        self._lib = llama_cpp
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = context_tokens
        params.n_threads = params.n_threads_batch = threads
        context = llama_cpp.llama_init_from_model(model, params)
        chain = sampler(llama_cpp, sampling)
        self._finalizer = weakref.finalize(self, free, llama_cpp, model, context, chain)
        if not context:
            raise RuntimeError(f"llama.cpp could not make a context of {context_tokens} tokens for {path}")
        self._context, self._sampler = context, chain

    def generate(self, prompt: Sequence[int], new_tokens: int) -> list[int]:
        """``new_tokens`` tokens after ``prompt`` (token ids), from an empty KV cache."""
        lib, context = self._lib, self._context
        lib.llama_memory_clear(lib.llama_get_memory(context), True)
        self._decode(prompt)
        tokens: list[int] = []
        while True:
            tokens.append(lib.llama_sampler_sample(self._sampler, context, -1))
            if len(tokens) == new_tokens:
                return tokens
            self._decode(tokens[-1:])

    def _decode(self, ids: Sequence[int]) -> None:
        array = (self._lib.llama_token * len(ids))(*ids)
        status = self._lib.llama_decode(self._context, self._lib.llama_batch_get_one(array, len(ids)))
        if status != 0:
            raise RuntimeError(f"llama_decode failed (status {status}) on a batch of {len(ids)} tokens")


def free(llama_cpp: Any, model: Any, context: Any, chain: Any) -> None:
    """Release what a :class:`LlamaCppDecoder` holds (the null handles of a failed load skipped)."""
    llama_cpp.llama_sampler_free(chain)
    if context:
        llama_cpp.llama_free(context)
    if model:
        llama_cpp.llama_model_free(model)


def llama_cpp_runs(
    path: Path, threads: int, context_tokens: int, sampling: SamplingConfig
) -> tuple[tuple[Run, Run], int]:
    """A row's decode and first-token runs (one decoder for both), and the weight bytes a decode step reads."""
    decoder = LlamaCppDecoder(path, threads, context_tokens, sampling)

    def run(prompt: list[int], new_tokens: int) -> None:
        decoder.generate(prompt, new_tokens)

    return (run, run), gguf_bytes_per_token(path)


def llama_cpp_files(source: Path, threads: int, write: Callable[[str], None]) -> dict[str, Path]:
    """Each of :data:`FORMS` that can be had, by name: ``source`` itself for its own form, the others requantized
    into the per-user cache; a form llama.cpp cannot make is said with ``write`` and left out."""
    files = {FORMS[0]: source}
    for form in FORMS[1:]:
        try:
            files[form] = requantized(source, form, user_cache_dir() / CACHE_SUBDIR, threads)
        except RuntimeError as error:
            write(f"not measured: llama.cpp {form}: {error}")
    for form, path in files.items():
        write(f"llama.cpp {form}: {path} ({gguf_types(path)})")
    return files


def llama_cpp_builders(
    shape_name: str,
    shape: ModelConfig,
    device: torch.device,
    context_tokens: int,
    sampling: SamplingConfig,
    write: Callable[[str], None],
) -> dict[str, Callable[[], tuple[tuple[Run, Run], int]]]:
    """The llama.cpp rows of a run on ``device``, by name, each built when measured: none (said with ``write``
    on the CPU) off the CPU, without ``llama-cpp-python``, or for another shape than the default model's. Their
    threads are torch's now, our rows' count."""
    if device.type != "cpu":
        return {}
    version = llama_cpp_version()
    if version is None:
        write("llama-cpp-python is not importable: llama.cpp rows skipped")
        return {}
    if shape_name != DEFAULT_SHAPE:
        write(f"llama.cpp rows skipped: they run the default model, whose shape is {DEFAULT_SHAPE}, not {shape_name}")
        return {}
    source = default_gguf()
    if not gguf_matches(source, shape):
        write(f"llama.cpp rows skipped: {source} is not a model of shape {shape_name}")
        return {}
    threads = torch.get_num_threads()
    return {
        f"llama.cpp (llama-cpp-python {version}) {form}": functools.partial(
            llama_cpp_runs, path, threads, context_tokens, sampling
        )
        for form, path in llama_cpp_files(source, threads, write).items()
    }
