"""The engine: gpt-fast as a Python library, and the one boundary every command sits on.

    from gpt_fast import Engine, SamplingConfig
    engine = Engine.load("checkpoints/ORG/NAME", compile="reduce-overhead", device="cuda")  # or Engine.load()
    for piece in engine.stream("def quicksort(arr):", max_new_tokens=200, sampling=SamplingConfig(0.8, 200)):
        print(piece, end="")

An engine is opened in two steps so that a command can refuse a bad request before any weights are read:
:meth:`Engine.open` reads the checkpoint's ``config.json`` (once) and its tokenizer and resolves the device;
:meth:`Engine.load_weights` then reads the weights. :meth:`Engine.load` does both.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Callable, Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gpt_fast.accel.choice import Context
from gpt_fast.accel.invariant import INVARIANT_ROWS, check_invariant, use_invariant_kernels
from gpt_fast.accel.registry import install_kernels, load_kernels, resolve_kernels
from gpt_fast.checkpoint.load import checkpoint_tokenizer, load_model, model_from_state
from gpt_fast.convert.default_model import DEFAULT_MODEL, INT4_NOTE, ensure_default_checkpoint
from gpt_fast.engine.batcher import Batcher, Event, Finished, Request
from gpt_fast.engine.options import MAX_BATCH, BatchOptions, EngineOptions
from gpt_fast.generation.constraint import Grammars, Matcher, tool_call_constraint
from gpt_fast.generation.decode import (
    CompileCacheUse,
    cache_length,
    compile_cache_use,
    generate_stream,
    make_steps,
)
from gpt_fast.generation.drafters import Drafter
from gpt_fast.generation.loop import GenerationResult, drain
from gpt_fast.generation.options import OutputConstraint, ToolSpec
from gpt_fast.generation.precompile import PrecompiledStep
from gpt_fast.generation.profiling import record_trace
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.generation.scoring import token_scores
from gpt_fast.generation.slots import SlotSteps, make_slot_steps
from gpt_fast.generation.speculative import (
    SpeculativeOptions,
    SpeculativeSteps,
    check_draft_config,
    make_drafter,
    make_speculative_steps,
    speculative_stream,
)
from gpt_fast.model.config import (
    CheckpointConfig,
    ModelConfig,
    QuantConfig,
    load_checkpoint_config,
    resolve_checkpoint_dir,
)
from gpt_fast.model.transformer import Transformer, weight_bytes_per_token
from gpt_fast.parallel.tensor_parallel import TensorParallel, device_of, env_ranks, join
from gpt_fast.quant.products import CPP_KERNELS, cpp_usable
from gpt_fast.text.chat_template import chat_prompt_ids
from gpt_fast.text.textstream import TextStream
from gpt_fast.text.tokenizer import Tokenizer
from gpt_fast.text.tool_calls import ToolCall, ToolCallFormat
from gpt_fast.util.choices import DEFAULT_MAX_NEW_TOKENS
from gpt_fast.util.device import (
    device_memory_bytes,
    device_name,
    dtype_name,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from gpt_fast.util.fileio import check_output_file
from gpt_fast.util.options import OptionError
from gpt_fast.util.paths import CHECKPOINTS_DIR

Message = dict[str, Any]  # {"role": ..., "content": ...}; an assistant's "tool_calls", a tool's "tool_call_id"
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class Completion:
    """One generated continuation."""

    prompt_ids: list[int]
    ids: list[int]  # the new tokens, a stop token included
    text: str  # their text, special tokens left out
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens reached)
    seconds: float  # prefill + decode, wall time
    ttft_seconds: float  # time to the first new token

    @property
    def tokens_per_sec(self) -> float:
        return len(self.ids) / self.seconds


def find_checkpoint(checkpoint: str | Path | None, int4_default: bool = False) -> Path:
    """The checkpoint folder for a path (the folder or its ``model.pth``), an ``ORG/NAME`` prepared under
    ``checkpoints/``, or None: the embedded default model (prepared on first use), in its int4 form with
    ``int4_default``."""
    if checkpoint is None:
        return ensure_default_checkpoint(int4=int4_default).parent
    path = Path(checkpoint)
    if path.exists():
        return resolve_checkpoint_dir(path)
    name = str(checkpoint)
    if _REPO_ID.fullmatch(name):
        prepared = CHECKPOINTS_DIR / name
        if prepared.is_dir():
            return prepared
        raise FileNotFoundError(
            f"checkpoint not found: {name} (nor {prepared}); prepare it with: gpt-fast prepare {name}"
        )
    raise FileNotFoundError(f"checkpoint not found: {path}")


def default_in_int4(options: EngineOptions) -> bool:
    """Whether the default model opens in its int4 form (:mod:`gpt_fast.convert.default_model`, the same weights
    as float32): float32 steps of one process on a CPU whose quantized products are our C++ kernels, where it
    decodes faster (docs/cpu.md), and which take quantized layers (not batch-invariant steps)."""
    device = resolve_device(options.device)
    plain = options.tp == 1 and not options.batch_invariant and options.dtype in ("auto", "float32")
    return plain and options.kernels.quant in ("auto", *CPP_KERNELS) and cpp_usable(device)


class Engine:
    """A checkpoint ready to generate: config, tokenizer, device, dtype, the (compiled) step functions and, once
    :meth:`load_weights` has run, the model."""

    def __init__(
        self,
        options: EngineOptions,
        model_config: ModelConfig,
        *,
        checkpoint_dir: Path | None = None,
        config: CheckpointConfig | None = None,
        state: Mapping[str, torch.Tensor] | None = None,
        quantization: QuantConfig | None = None,
        draft: Engine | None = None,
        sharded: bool = False,
    ) -> None:
        """Use :meth:`open`, :meth:`load` or :meth:`from_state`."""
        self.options = options
        self.model_config = model_config
        self.checkpoint_dir = checkpoint_dir
        self.config = config  # the checkpoint's config.json; None for weights given in memory
        self.quantization = config.quantization if config is not None else quantization
        options.check_parallel(model_config, self.quantization)
        if options.batch_invariant:
            check_invariant(model_config, self.quantization)
        self.ranks = env_ranks() if options.tp > 1 else None  # None: one process (or the launcher of the ranks)
        self.device = resolve_device(options.device)
        if options.tp > 1:
            self.device = device_of(self.device, self.ranks)
        self.dtype = resolve_dtype(options.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(options.kv_cache_dtype, self.dtype, self.device)
        self.kernel_context = Context(
            self.device,
            options.compile,
            model_config,
            self.quantization,
            regional_compile=options.regional_compile,
            batch_invariant=options.batch_invariant,
            tensor_parallel=options.tp > 1,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
        )
        self.kernels = resolve_kernels(options.kernels, self.kernel_context)  # built in load_weights
        self._tokenizer = checkpoint_tokenizer(checkpoint_dir, config) if config is not None else None
        self._state = state
        self._sharded = sharded  # the state is this rank's part already
        self._parallel: TensorParallel | None = None  # the group, once joined (load_weights)
        self._folder_id = folder_identity(checkpoint_dir)
        self._steps = make_steps(
            options.compile,
            options.compile_prefill,
            options.kernel_tuning,
            options.aot_precompile,
            exact=options.batch_invariant,
            graph_prefill=options.tp == 1,  # no GPU run has captured a prefill's collectives yet
        )
        self._slot_steps: SlotSteps | None = None  # made on first use of a batcher
        self._model: Transformer | None = None
        self._draft = draft  # the draft checkpoint's engine, for speculative decoding with a draft model
        self._drafter: Drafter | None = None  # made from options.speculative once the weights are loaded
        self._spec_steps: SpeculativeSteps | None = None
        self._profile_marks = False
        self._grammars: Grammars | None = None  # the grammar engine over the vocabulary, made on first use
        self.load_seconds: float | None = None
        self.form_note: str | None = None  # which form of the default model was opened, where it says so

    @classmethod
    def open(cls, checkpoint: str | Path | None = None, options: EngineOptions | None = None) -> Engine:
        """Everything but the weights: every check that needs no weights happens here."""
        options = options or EngineOptions()
        int4_default = checkpoint is None and default_in_int4(options)
        directory = find_checkpoint(checkpoint, int4_default)
        config = load_checkpoint_config(directory)
        draft = None
        if options.speculative is not None and options.speculative.draft_checkpoint is not None:
            draft_options = replace(options, speculative=None, batch_invariant=False)  # its rounding does not matter
            draft = cls.open(options.speculative.draft_checkpoint, draft_options)
            check_draft_config(config, draft.config, draft.checkpoint_dir)
        engine = cls(options, config.model, checkpoint_dir=directory, config=config, draft=draft)
        engine.form_note = f"the default {DEFAULT_MODEL.split('/')[-1]}, {INT4_NOTE}" if int4_default else None
        return engine

    @classmethod
    def load(
        cls,
        checkpoint: str | Path | None = None,
        *,
        compile: str = "none",
        compile_prefill: bool = False,
        device: str | None = None,
        dtype: str = "auto",
        speculative: SpeculativeOptions | None = None,
        tp: int = 1,
    ) -> Engine:
        """Open ``checkpoint`` (None: the default model) and read its weights (and the draft's); with ``tp``, this
        rank's part of them (run under ``torchrun --nproc_per_node TP``)."""
        options = EngineOptions(compile, compile_prefill, device, dtype, speculative, tp=tp)
        engine = cls.open(checkpoint, options)
        engine.load_weights()
        return engine

    @classmethod
    def from_state(
        cls,
        model_config: ModelConfig,
        state: Mapping[str, torch.Tensor],
        options: EngineOptions | None = None,
        quantization: QuantConfig | None = None,
        *,
        sharded: bool = False,
    ) -> Engine:
        """An engine over weights already in memory (benchmarks on random weights; ``quantization`` says how
        ``state`` is quantized, as a checkpoint's config.json would). It has no tokenizer: it takes and gives
        token ids only (:meth:`generate_ids`), and never stops early. It speculates with prompt lookup or a drafter
        given to :meth:`generate_ids`, not with a draft checkpoint. With tensor parallelism (``options.tp``) each
        rank takes its part of the whole model's ``state``, or, ``sharded``, ``state`` is that part already
        (shapes: :meth:`gpt_fast.parallel.tensor_parallel.Shard.shard_shapes`)."""
        options = options or EngineOptions()
        if options.speculative is not None and options.speculative.draft_checkpoint is not None:
            raise ValueError("an engine over weights in memory cannot open a draft checkpoint: pass a drafter")
        engine = cls(options, model_config, state=state, quantization=quantization, sharded=sharded)
        engine.load_weights()
        return engine

    def load_weights(self) -> None:
        """Build what the chosen kernels need, then read the weights (with tensor parallelism, join the ranks' group
        first and read this rank's part)."""
        start = time.perf_counter()
        load_kernels(self.kernels)
        if self.options.tp > 1 and self._parallel is None:
            self._parallel = join(self.options.tp, self.device)
        shard = self._parallel.shard if self._parallel is not None else None
        if self._state is not None:
            state = self._state if shard is None or self._sharded else shard.slice_state(self._state, self.model_config)
            self._model = model_from_state(
                self.model_config,
                state,
                self.device,
                self.dtype,
                self.quantization,
                self.kernels.quant,
                shard,
            )
            self._state = None
        else:
            if folder_identity(self.checkpoint_dir) != self._folder_id:
                raise ValueError(f"checkpoint {self.checkpoint_dir} was replaced since it was opened; run again")
            self._model = load_model(
                self.checkpoint_dir,
                self.config,
                self.device,
                self.dtype,
                self.kernels.quant,
                shard,
            )
        self._model.kv_dtype_name = dtype_name(self.kv_dtype)
        install_kernels(self._model, self.kernels, self.kernel_context)
        if self._parallel is not None:
            self._parallel.connect(self._model, self.model_config)
        if self.options.batch_invariant:
            use_invariant_kernels(self._model, self.device)
        self._model.regional_compile = self.options.regional_compile
        if self._draft is not None:
            self._draft.load_weights()
        if self.options.speculative is not None:
            self._drafter = make_drafter(self.options.speculative, self._draft.model if self._draft else None)
        self.load_seconds = time.perf_counter() - start

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("this engine has no tokenizer (its weights were given in memory): use token ids")
        return self._tokenizer

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._tokenizer.stop_ids if self._tokenizer is not None else ()

    @property
    def model(self) -> Transformer:
        if self._model is None:
            raise RuntimeError("the engine's weights are not loaded yet: call load_weights() first")
        return self._model

    @property
    def compile(self) -> str:
        return self.options.compile

    @property
    def parallel(self) -> TensorParallel | None:
        """This rank's part in tensor parallelism, once the weights are loaded; None in a single process."""
        return self._parallel

    @property
    def world_size(self) -> int:
        """The processes the model is split over (``options.tp``)."""
        return self.options.tp

    @property
    def rank(self) -> int:
        """This process's rank (0 in a single process): only rank 0 prints and writes files."""
        return self.ranks.rank if self.ranks is not None else 0

    @staticmethod
    def compile_cache_use() -> CompileCacheUse:
        """How the compilations so far used the on-disk compile cache (``.label``: warm, cold or partly warm)."""
        return compile_cache_use()

    @property
    def aot_package(self) -> str | None:
        """With ``aot_precompile``: how the decode step's latest package was obtained (loaded from disk, or
        compiled and saved, and where); None otherwise or before the first decode step."""
        decode = self._steps.decode
        return decode.outcome if isinstance(decode, PrecompiledStep) else None

    @property
    def device_name(self) -> str:
        return device_name(self.device)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def drafter(self) -> Drafter | None:
        """What proposes tokens for speculative decoding (None: plain decoding), once the weights are loaded."""
        return self._drafter

    @property
    def speculative_steps(self) -> SpeculativeSteps:
        """The steps of a speculative round, compiled as the engine's compile mode says (made on first use)."""
        if self._spec_steps is None:
            self._spec_steps = make_speculative_steps(
                self.options.compile, self.options.kernel_tuning, exact=self.options.batch_invariant
            )
        return self._spec_steps

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (see :func:`gpt_fast.model.transformer.weight_bytes_per_token`)."""
        return weight_bytes_per_token(self.model)

    # --- text ---------------------------------------------------------------------------------------------------

    def encode(self, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Prompt ids of ``text``: as written (special-token strings in it become their ids, BOS added as the
        checkpoint says) or, with ``chat``, as one user turn (after an optional system message) through the
        checkpoint's chat template."""
        if chat:
            return self.chat_ids(user_turn(text, system))
        if system is not None:
            raise OptionError("system goes with chat (a system message is part of a chat)", "system", "chat")
        return self.tokenizer.encode(text, bos=True)

    @property
    def chat_template(self) -> str | None:
        return self.config.chat_template if self.config is not None else None

    def chat_ids(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids of a conversation rendered with the checkpoint's chat template, ready for the answer; ``tools``
        (OpenAI's ``{"type": "function", "function": {...}}`` objects) go to the template as transformers passes
        them. ValueError for tools a template does not write (:attr:`tool_call_format`)."""
        if tools is not None and self.tool_call_format is None:
            raise ValueError("this model's chat template does not write tool calls: it cannot be given tools")
        return chat_prompt_ids(
            self.tokenizer, self.chat_template, list(messages), None if tools is None else list(tools)
        )

    @functools.cached_property
    def tool_call_format(self) -> ToolCallFormat | None:
        """How the chat template writes an assistant's tool calls (None: it writes none, or renders no tools)."""
        if not self.chat_template:
            return None
        tok = self.tokenizer
        stops = [tok.decode([token]) for token in tok.stop_ids]
        return ToolCallFormat.of_template(self.chat_template, tok.bos_token, tok.eos_token, stops)

    def tool_call_constraint(
        self,
        tools: Sequence[ToolSpec],
        only: str | None = None,
        parallel: bool = True,
        answer: OutputConstraint | None = None,
    ) -> OutputConstraint:
        """The constraint of an answer made of calls of ``tools`` (of the one named ``only``) as the template
        writes them: one, or several where ``parallel`` and the template allow; or, with ``answer`` (a JSON
        schema's constraint), a document matching it instead."""
        if self.tool_call_format is None:
            raise ValueError("this model's chat template does not write tool calls")
        vocab = self.model_config.vocab_size
        specials = {text: token for text, token in self.tokenizer.special_tokens.items() if token < vocab}
        return tool_call_constraint(self.tool_call_format, tools, specials, only=only, parallel=parallel, answer=answer)

    def parse_tool_calls(self, ids: Sequence[int], names: Collection[str]) -> tuple[str, list[ToolCall]]:
        """The calls of the functions ``names`` an answer's ``ids`` make, written as the template writes them, and
        the answer's text before them; ``(text, [])`` if it makes none."""
        text = self.tokenizer.decode([token for token in ids if token not in self.stop_ids])
        if self.tool_call_format is None:
            return text, []
        return self.tool_call_format.parse(text, names)

    @property
    def grammars(self) -> Grammars:
        """The grammar engine over this checkpoint's vocabulary (made on first use: about half a second)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        return self._grammars

    def compile_constraint(self, constraint: OutputConstraint) -> Matcher:
        """A matcher at the start of ``constraint`` (GrammarError, a ValueError, if the engine refuses it)."""
        return self.grammars.matcher(constraint)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens left out."""
        return self.tokenizer.decode(ids, skip_special=True)

    def check_fits(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Raise ValueError (before any allocation) if the request does not fit the model's context."""
        if max_new_tokens < 1:
            raise OptionError(f"max_new_tokens must be >= 1, got {max_new_tokens}", "max_new_tokens")
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        cache_length(len(prompt_ids), max_new_tokens, self.model_config.block_size)

    def check_batch_size(self, batch_size: int, prompt_length: int, max_new_tokens: int) -> None:
        """Raise ValueError (before any allocation) if ``batch_size`` rows' KV cache alone, sized from the model's
        config (this rank's part with tensor parallelism), exceeds the device's whole memory."""
        config = self.model_config
        length = cache_length(prompt_length, max_new_tokens, config.block_size)
        kv_size = config.kv_size // self.world_size  # each rank holds whole key/value heads
        row_bytes = 2 * config.n_layer * kv_size * length * self.kv_dtype.itemsize  # keys and values of one row
        needed, memory = batch_size * row_bytes, device_memory_bytes(self.device)
        if needed > memory:
            raise ValueError(
                f"--batch_size {batch_size}: the KV cache alone needs {needed / 1e9:.1f} GB ({row_bytes / 1e6:.1f} MB "
                f"per sequence), more than the {memory / 1e9:.1f} GB of {self.device_name}; at most "
                f"{memory // row_bytes} sequences fit"
            )

    # --- scoring ------------------------------------------------------------------------------------------------

    def log_likelihoods(self, ids: Sequence[int]) -> torch.Tensor:
        """``log p(ids[i] | ids[:i])`` for ``i = 1 .. len(ids) - 1`` under the model, float32 on the CPU: one
        window of text scored in one forward pass (perplexity, :mod:`gpt_fast.jobs.evaluate`)."""
        return self.token_scores(ids)[0]

    def token_scores(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`log_likelihoods`, and whether each ``ids[i]`` is the model's most likely token there (bool): an
        evaluation asks both of a continuation (:mod:`gpt_fast.jobs.lm_eval_model`)."""
        if len(ids) < 2:
            raise ValueError(f"a window to score needs at least 2 tokens, got {len(ids)}")
        if len(ids) > self.model_config.block_size:
            raise ValueError(
                f"a window of {len(ids)} tokens exceeds the model's context of {self.model_config.block_size} tokens"
            )
        return token_scores(self.model, ids)

    # --- generation ---------------------------------------------------------------------------------------------

    def sampling_choice(
        self, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None
    ) -> tuple[SamplingConfig, str]:
        """The sampling of a request and a line saying where each value comes from: each value given here, else the
        one the checkpoint recommends (``config.json``'s ``generation``), else :class:`SamplingConfig`'s default."""
        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        given = {name: value for name, value in given.items() if value is not None}
        recommended = self.config.generation if self.config is not None else None
        from_checkpoint = (
            {} if recommended is None else {k: v for k, v in recommended.given().items() if k not in given}
        )
        source = "" if recommended is None else recommended.source
        if from_checkpoint.get("top_k") == 0:  # the whole vocabulary
            from_checkpoint["top_k"] = None
        sampling = SamplingConfig(**(from_checkpoint | given))
        sources = dict.fromkeys(given, "given") | dict.fromkeys(from_checkpoint, source)

        def shown(name: str) -> str:
            value = getattr(sampling, name)
            value = "the whole vocabulary" if value is None else f"{value:g}"
            return f"{name} {value} ({sources.get(name, 'default')})"

        if sampling.greedy:
            return sampling, f"greedy: {shown('temperature')}"
        return sampling, ", ".join(shown(name) for name in ("temperature", "top_k", "top_p"))

    def generate(
        self,
        prompts: str | Sequence[str],
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingConfig | None = None,
        *,
        chat: bool = False,
        system: str | None = None,
        ignore_eos: bool = False,
        constraint: OutputConstraint | None = None,
    ) -> list[Completion]:
        """A completion for each prompt; several prompts are generated together (:meth:`generate_many_ids`), or,
        with speculative decoding, one after another. Every prompt is encoded and checked against the context
        before the first is generated. Without ``sampling``, the checkpoint's recommended sampling
        (:meth:`sampling_choice`). ``constraint``: what each answer must match (a JSON schema, a grammar)."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        all_ids = [self.encode(text, chat=chat, system=system) for text in texts]
        for ids in all_ids:
            self.check_fits(ids, max_new_tokens)
        sampling = sampling or self.sampling_choice()[0]
        if len(all_ids) > 1 and self.options.speculative is None:
            return self.generate_many_ids(
                all_ids, max_new_tokens, sampling, ignore_eos=ignore_eos, constraint=constraint
            )
        return [self._complete(ids, max_new_tokens, sampling, ignore_eos, constraint) for ids in all_ids]

    def _complete(
        self,
        ids: list[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        ignore_eos: bool,
        constraint: OutputConstraint | None,
    ) -> Completion:
        result = self.generate_ids(ids, max_new_tokens, sampling, ignore_eos=ignore_eos, constraint=constraint)
        new = result.tokens[0]
        finish = "stop" if new and new[-1] in self.stop_ids and not ignore_eos else "length"
        return Completion(ids, new, self.decode(new), finish, result.seconds, result.ttft_seconds)

    def stream(
        self,
        prompt: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingConfig | None = None,
        *,
        chat: bool = False,
        system: str | None = None,
        constraint: OutputConstraint | None = None,
    ) -> Iterator[str]:
        """The continuation's text, piece by piece as it is generated (a piece is held back until it is whole
        UTF-8). Stops at a stop token or after ``max_new_tokens``. Without ``sampling``, the checkpoint's recommended
        sampling (:meth:`sampling_choice`); ``constraint``: what the answer must match."""
        ids = self.encode(prompt, chat=chat, system=system)
        return self.stream_ids(ids, max_new_tokens, sampling or self.sampling_choice()[0], constraint)

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        constraint: OutputConstraint | None = None,
    ) -> Iterator[str]:
        """:meth:`stream` for prompt ids already encoded."""
        self.check_fits(prompt_ids, max_new_tokens)
        pieces: list[str] = []
        text = TextStream(self.tokenizer, prompt_ids, pieces.append)
        tokens = self._token_stream(prompt_ids, max_new_tokens, sampling, stop_ids=self.stop_ids, constraint=constraint)
        for step_tokens in tokens:
            text.push(step_tokens[0])
            yield from pieces
            pieces.clear()

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        *,
        batch_size: int = 1,
        ignore_eos: bool = False,
        on_text: Callable[[str], None] | None = None,
        drafter: Drafter | None = None,
        constraint: OutputConstraint | None = None,
    ) -> GenerationResult:
        """The lower-level call the commands use: ``batch_size`` copies of one prompt already encoded; the first
        row's text goes to ``on_text`` as it is generated. With speculative decoding (the engine's options, or
        ``drafter``: benchmarks pass their own) the result is a
        :class:`gpt_fast.generation.speculative.SpeculativeResult`. ``constraint``: what each row's answer must
        match (decoded plainly, each token read back before the next step)."""
        self.check_fits(prompt_ids, max_new_tokens)
        self.check_batch_size(batch_size, len(prompt_ids), max_new_tokens)
        on_tokens = None
        if on_text is not None:
            text = TextStream(self.tokenizer, prompt_ids, on_text)

            def on_tokens(step_tokens: list[int]) -> None:
                text.push(step_tokens[0])

        stream = self._token_stream(
            prompt_ids,
            max_new_tokens,
            sampling,
            batch_size=batch_size,
            stop_ids=() if ignore_eos else self.stop_ids,
            emit=on_tokens is not None,
            drafter=drafter,
            constraint=constraint,
        )
        return drain(stream, on_tokens)

    def _token_stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        *,
        stop_ids: Sequence[int],
        batch_size: int = 1,
        emit: bool = True,
        drafter: Drafter | None = None,
        constraint: OutputConstraint | None = None,
    ) -> Generator[list[int], None, GenerationResult]:
        """Plain decoding (held to ``constraint`` where given), or speculative decoding with ``drafter`` or the
        engine's own."""
        drafter = drafter if drafter is not None else self._drafter
        common = {
            "max_new_tokens": max_new_tokens,
            "sampling": sampling,
            "steps": self._steps,
            "batch_size": batch_size,
            "stop_ids": stop_ids,
            "emit": emit,
            "profile_marks": self._profile_marks,
        }
        if constraint is not None:
            if drafter is not None:
                raise OptionError(
                    "a constrained answer is decoded plainly: turn speculative decoding off", "speculative"
                )
            matchers = [self.compile_constraint(constraint) for _ in range(batch_size)]
            return generate_stream(self.model, prompt_ids, **common, matchers=matchers)
        if drafter is None:
            stream = generate_stream(self.model, prompt_ids, **common)
            return stream if self._parallel is None else self._same_on_every_rank(stream)
        if self.options.batch_invariant and batch_size * (drafter.k + 1) > INVARIANT_ROWS:
            raise OptionError(
                f"batch_invariant verifies up to {INVARIANT_ROWS} rows per step: batch {batch_size} x "
                f"(k {drafter.k} + 1) is more",
                "batch_invariant",
            )
        return speculative_stream(self.model, drafter, prompt_ids, spec_steps=self.speculative_steps, **common)

    def _same_on_every_rank(
        self, stream: Generator[list[int], None, GenerationResult]
    ) -> Generator[list[int], None, GenerationResult]:
        result = yield from stream
        self._parallel.check_same_tokens(result.tokens)
        return result

    def generate_many_ids(
        self,
        prompts_ids: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingConfig,
        *,
        ignore_eos: bool = False,
        constraint: OutputConstraint | None = None,
    ) -> list[Completion]:
        """A completion for each of several prompts already encoded, generated together by continuous batching (up
        to MAX_BATCH at once; more wait for a slot), each held to ``constraint`` where given. Each row samples with
        its own seed, drawn from torch's generator, so that :func:`set_seed` makes the whole batch reproducible."""
        for ids in prompts_ids:
            self.check_fits(ids, max_new_tokens)
        longest = max(len(ids) for ids in prompts_ids)
        options = BatchOptions(
            max_batch=min(len(prompts_ids), MAX_BATCH),
            max_seq_length=cache_length(longest, max_new_tokens, self.model_config.block_size),
            max_queue=len(prompts_ids),
        )
        batcher = self.batcher(options)
        finished: dict[int, Finished] = {}
        seeds = torch.randint(2**62, (len(prompts_ids),)).tolist()
        for row, (ids, seed) in enumerate(zip(prompts_ids, seeds, strict=True)):

            def keep(event: Event, row: int = row) -> None:
                if isinstance(event, Finished):
                    finished[row] = event

            request = Request(
                tuple(ids), max_new_tokens, sampling, seed=seed, ignore_eos=ignore_eos, constraint=constraint
            )
            batcher.submit(request, keep)
        batcher.run()
        return [self._completion(list(ids), finished[row]) for row, ids in enumerate(prompts_ids)]

    def _completion(self, prompt_ids: list[int], done: Finished) -> Completion:
        text = self.decode(done.ids) if self._tokenizer is not None else ""
        return Completion(prompt_ids, list(done.ids), text, done.finish_reason, done.seconds, done.ttft_seconds or 0.0)

    def batcher(self, options: BatchOptions | None = None) -> Batcher:
        """A :class:`~gpt_fast.engine.batcher.Batcher` over this engine's model: requests from many clients decoded
        together, each in its own slot of the cache (what `gpt-fast serve` runs). It takes over the model's cache:
        run one batcher, or single-stream generation, at a time."""
        self.options.check_batching()
        if self._slot_steps is None:
            opts = self.options
            self._slot_steps = make_slot_steps(
                opts.compile, opts.compile_prefill, opts.kernel_tuning, exact=opts.batch_invariant
            )
        return Batcher(
            self.model,
            self._slot_steps,
            options or BatchOptions(),
            tokenizer=self._tokenizer,
            stop_ids=self.stop_ids,
            compile_constraint=self.compile_constraint if self._tokenizer is not None else None,
        )

    @contextlib.contextmanager
    def profiled(self, trace_path: str | os.PathLike[str]) -> Iterator[None]:
        """Record the generations inside the block with the PyTorch profiler into ``trace_path`` (Perfetto), with the
        prefill and every decode step marked for ``gpt-fast trace-summary``. The path is checked before the block
        runs (its folder must exist and be writable)."""
        path = check_output_file(Path(trace_path), "trace_path")
        self._profile_marks = True
        try:
            with record_trace(path, self.device):
                yield
        finally:
            self._profile_marks = False


def folder_identity(folder: Path | None) -> tuple[int, int] | None:
    """Which folder is at ``folder`` now: a conversion replaces a checkpoint by swapping in a new folder, and the
    weights must come from the folder whose config was read."""
    if folder is None:
        return None
    info = folder.stat()
    return info.st_dev, info.st_ino


def launched_world_size() -> int:
    """The number of processes ``torchrun`` started this one among (1 outside torchrun)."""
    ranks = env_ranks()
    return ranks.world_size if ranks is not None else 1


def user_turn(text: str, system: str | None = None) -> list[Message]:
    """A conversation of one user message, after a system message if one is given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


def set_seed(seed: int | None) -> None:
    """Seed sampling (torch's global generator, on every device) when ``seed`` is given."""
    if seed is not None:
        torch.manual_seed(seed)
