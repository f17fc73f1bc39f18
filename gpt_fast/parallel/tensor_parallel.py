"""Tensor parallelism: one decoder split over the processes of a ``torch.distributed`` group, one GPU each.

Each process (rank) holds a slice of every layer, as in Megatron-LM: the attention by heads (its ``wqkv`` rows of
its query heads and of their key/value heads, and the KV cache of those heads alone), the MLP by hidden units
(``w13``'s rows of its gate and up units); ``wo`` and ``w2`` by the matching input columns, so that each rank's
product is a partial sum of the layer's output, and one all-reduce per attention and one per MLP makes the whole.
The output head is split by vocabulary rows when the vocabulary divides (:data:`SHARD_HEAD`): each rank computes
its rows' logits and one all-gather joins them. The embedding table stays whole on every rank: a decode step reads
one row of it, and splitting it would cost a collective for nothing read.

Processes are started by ``torchrun`` (``gpt-fast generate --tp N`` starts it: :mod:`gpt_fast.parallel.launch`), which
sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; the local rank picks the GPU, so that the same command runs over
several hosts. The collectives are PyTorch's: the all-reduce ``dist.all_reduce`` inside an opaque operator
(:func:`register_all_reduce`), the head's all-gather a functional collective; ``torch.compile`` puts both into the
decode step's graph (the CUDA-graph modes capture them too); NCCL on GPUs (RCCL on ROCm, under the same name),
gloo on the CPU. With our fused GEMVs a layer's residual adds and norms stay inside them (:class:`ParallelRow`).

The model knows none of this (:mod:`gpt_fast.model` imports no ``torch.distributed``): :meth:`TensorParallel.connect`
wraps its row-parallel layers and its head, after the weights are loaded, in modules that add the collective.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import gc
import importlib
import os
import re
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol

from gpt_fast.accel.linear import FusedRow
from gpt_fast.model.config import ModelConfig, QuantConfig
from gpt_fast.model.transformer import RMSNorm, Transformer
from gpt_fast.quant.layers import LINEARS
from gpt_fast.quant.layout import quantized_tensors, stored_specs
from gpt_fast.util.options import OptionError

# How long a rank waits in a collective (or for the others to join) before it gives up with an error: longer
# than a compilation that one rank may finish before the others, short enough that a stuck rank ends the run.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# The head split by vocabulary rows (one all-gather of the logits per step) when the vocabulary divides by the
# ranks; False: every rank computes all the logits (it reads the whole head each step).
SHARD_HEAD = True
OUTPUT = "output"
COLUMN_PARALLEL = re.compile(r"layers\.\d+\.(attention\.wqkv|feed_forward\.w13)")  # split by output rows
ROW_PARALLEL = re.compile(r"layers\.\d+\.(attention\.wo|feed_forward\.w2)")  # split by input columns
# all_gather_tensor was renamed all_gather_single after torch 2.11 (the old name warns, then goes)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process stands, as ``torchrun`` says: its rank among all, their number, its rank on its host."""

    rank: int
    world_size: int
    local_rank: int


def env_ranks() -> Ranks | None:
    """The ranks ``torchrun`` (or any launcher that follows its convention) put in the environment; None outside
    one."""
    if "WORLD_SIZE" not in os.environ:
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        text = os.environ.get(name, "")
        if not text.isdigit():
            raise ValueError(f"environment variable {name}={text!r} is not a rank (torchrun sets it)")
        values[name] = int(text)
    ranks = Ranks(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
    if not ranks.rank < ranks.world_size:
        raise ValueError(f"environment: RANK={ranks.rank} is not below WORLD_SIZE={ranks.world_size}")
    return ranks


def check_tensor_parallel(config: ModelConfig, quant: QuantConfig | None, size: int) -> None:
    """Refuse, before any weights are read, a model that does not split over ``size`` ranks (one line each)."""
    if size < 1:
        raise OptionError(f"tp must be >= 1, got {size}", "tp")
    if size == 1:
        return
    if config.is_moe:
        raise OptionError(f"tp {size}: tensor parallelism does not split mixture-of-experts models yet", "tp")
    if size > config.n_local_heads:
        raise OptionError(
            f"tp {size} is more than the model's {config.n_local_heads} key/value heads (model.n_local_heads): "
            "each rank holds whole key/value heads",
            "tp",
        )
    for field in ("n_head", "n_local_heads", "intermediate_size"):
        if getattr(config, field) % size:
            raise OptionError(f"tp {size}: model.{field} ({getattr(config, field)}) is not divisible by {size}", "tp")
    if quant is not None and quant.embeddings is not None:
        raise OptionError(f"tp {size}: a quantized embedding table (quantization.embeddings) is not split yet", "tp")
    if quant is not None and quant.mode == "int4":
        for name, columns in (("attention.wo", config.q_size), ("feed_forward.w2", config.intermediate_size)):
            if (columns // size) % quant.group_size:
                raise OptionError(
                    f"tp {size}: {name}'s {columns // size} input columns per rank are not whole int4 groups of "
                    f"{quant.group_size} (quantization.group_size)",
                    "tp",
                )


def shards_head(config: ModelConfig, size: int) -> bool:
    return SHARD_HEAD and size > 1 and config.vocab_size % size == 0


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which part of the model rank ``rank`` of ``size`` holds: the slicing of a checkpoint's tensors, pure
    functions of the names and shapes (no process group)."""

    rank: int
    size: int

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's layers: its heads and hidden units (the vocabulary stays whole: the
        embedding table is replicated; the head's rows are set apart by :meth:`prepare`)."""
        return dataclasses.replace(
            config,
            n_head=config.n_head // self.size,
            n_local_heads=config.n_local_heads // self.size,
            intermediate_size=config.intermediate_size // self.size,
        )

    def _rows(self, tensor: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
        """This rank's rows of each of the stacked ``parts`` of ``tensor`` (q, k and v; gate and up), stacked."""
        pieces, start = [], 0
        for part in parts:
            step = part // self.size
            pieces.append(tensor[start + self.rank * step : start + (self.rank + 1) * step])
            start += part
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's input columns: weights (float, int8, or int4 two to a byte) and int4 groups split alike
        (whole groups: :func:`check_tensor_parallel`); int8's per-row scales are whole."""
        if tensor.dim() == 1:
            return tensor
        step = tensor.shape[1] // self.size
        return tensor[:, self.rank * step : (self.rank + 1) * step].contiguous()

    def row_parts(self, config: ModelConfig, prefix: str) -> tuple[int, ...] | None:
        """The stacked row blocks of a column-parallel layer ``prefix``, None for any other."""
        if prefix.endswith("wqkv"):
            return config.q_size, config.kv_size, config.kv_size
        if prefix.endswith("w13"):
            return config.intermediate_size, config.intermediate_size
        return (config.vocab_size,) if prefix == OUTPUT and shards_head(config, self.size) else None

    def slice_state(self, state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """This rank's tensors of a whole model's ``state`` (memory-mapped: only the slices are read), named as
        in the whole model; a tied head that is split gets its rows of the embedding table as ``output.weight``."""
        out = {}
        for name, tensor in state.items():
            prefix = name.rpartition(".")[0]
            parts = self.row_parts(config, prefix)
            if parts is not None and (COLUMN_PARALLEL.fullmatch(prefix) or prefix == OUTPUT):
                out[name] = self._rows(tensor, parts)
            elif ROW_PARALLEL.fullmatch(prefix):
                out[name] = self._columns(tensor)
            else:
                out[name] = tensor
        if shards_head(config, self.size) and f"{OUTPUT}.weight" not in state:
            out[f"{OUTPUT}.weight"] = self._rows(state["tok_embeddings.weight"], (config.vocab_size,))
        return out

    def prepare(self, model: Transformer, config: ModelConfig, quant: QuantConfig | None) -> None:
        """On a model of :meth:`local_config` built on the meta device: the head made of this rank's vocabulary
        rows (quantized as the checkpoint's head is)."""
        if not shards_head(config, self.size):
            return
        rows = config.vocab_size // self.size
        if quant is not None and quant.output:
            model.output = LINEARS[quant.mode](config.dim, rows, quant, bias=False)
        else:
            model.output = nn.Linear(config.dim, rows, bias=False)

    def shard_shapes(
        self, config: ModelConfig, dtype: torch.dtype, quant: QuantConfig | None = None
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``name -> (shape, dtype)`` of this rank's tensors (what :meth:`slice_state` makes of a checkpoint of
        ``config``), for making a rank's weights directly (benchmarks)."""
        specs = stored_specs(self.local_config(config), quant, dtype)
        if shards_head(config, self.size):
            rows = config.vocab_size // self.size
            for suffix in ("weight", "scales", "zeros"):
                specs.pop(f"{OUTPUT}.{suffix}", None)
            head = quantized_tensors(rows, config.dim, quant, dtype) if quant is not None and quant.output else None
            specs |= {f"{OUTPUT}.{s}": spec for s, spec in (head or {"weight": ((rows, config.dim), dtype)}).items()}
        return specs


@functools.cache
def register_all_reduce() -> None:
    """Register ``gpt_fast::all_reduce_sum_``: ``dist.all_reduce`` of a tensor in place, as one opaque operator.

    Not the functional all-reduce, which runs NCCL's kernel on the process group's own stream: in a captured decode
    step each one then waits for the switch of streams, 4-10 µs before each of the 64 all-reduces of a Llama-2-7B
    token on two H200s (docs/bench/HISTORY.md, 2026-11-24k). ``dist.all_reduce`` without ``async_op`` launches on the
    current stream (as it does with torch 2.11)."""
    import torch.distributed as dist

    @torch.library.custom_op("gpt_fast::all_reduce_sum_", mutates_args=("x",))
    def all_reduce_sum_(x: torch.Tensor, group_name: str) -> None:
        dist.all_reduce(x, group=dist.distributed_c10d._resolve_process_group(group_name))


class AllReduced(nn.Module):
    """A row-parallel layer: the partial products of the ranks summed (one all-reduce). ``first``: this is the
    group's first rank, the one that adds a residual into its partial product inside :class:`ParallelRow`'s
    kernel, so that the sum holds it once."""

    def __init__(self, layer: nn.Module, group_name: str, first: bool) -> None:
        super().__init__()
        self.layer, self.group_name, self.first = layer, group_name, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.layer(x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each one's ``partial`` (a tensor of this rank's, summed in place)."""
        torch.ops.gpt_fast.all_reduce_sum_(partial, self.group_name)
        return partial


class ParallelRow(FusedRow):
    """:class:`gpt_fast.accel.linear.FusedRow` for a layer whose ``wo`` and ``w2`` are :class:`AllReduced`: each
    rank's partial product in the same kernel, with the residual added inside the first rank's alone, then the
    all-reduce; the norm after it stays inside the next product, so that neither is a kernel of its own."""

    @staticmethod
    def linear(
        x: torch.Tensor,
        linear: nn.Module,
        residual: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        if not isinstance(linear, AllReduced):
            return FusedRow.linear(x, linear, residual, norm)
        partial = FusedRow.linear(x, linear.layer, residual if linear.first else None, norm)
        return linear.reduce(partial)


class AllGathered(nn.Module):
    """The head split by vocabulary rows: each rank's logits [..., V / N] joined into [..., V] (one all-gather).

    The ranks' blocks are gathered along the first dimension and laid side by side here: torch 2.11's dynamo
    refuses to trace the functional all-gather's own rearrangement for any other dimension. The group is named, as
    :class:`AllReduced`'s is: a compiled graph that read the group itself would keep it past :func:`leave`."""

    def __init__(self, layer: nn.Module, group_name: str, world_size: int) -> None:
        super().__init__()
        self.layer, self.group_name, self.world_size = layer, group_name, world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.layer(x)  # [B, ..., V / N]
        stacked = _all_gather(logits.contiguous(), 0, self.group_name)  # [N * B, ..., V / N]
        return torch.cat(torch.chunk(stacked, self.world_size, dim=0), dim=-1)  # [B, ..., V]


class TensorParallel:
    """This process's part in a tensor-parallel group that has been joined: its :class:`Shard` and the group."""

    def __init__(self, ranks: Ranks, group: object) -> None:
        self.ranks, self.group = ranks, group
        self.shard = Shard(ranks.rank, ranks.world_size)

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def size(self) -> int:
        return self.ranks.world_size

    def connect(self, model: Transformer, config: ModelConfig) -> None:
        """Put the collectives into a loaded model of :meth:`Shard.local_config` whose kernels are chosen: after
        each attention's ``wo`` and each MLP's ``w2`` an all-reduce, after a split head an all-gather; a layer
        that runs one row through :class:`FusedRow` runs it through :class:`ParallelRow`."""
        register_all_reduce()
        name, first = self.group.group_name, self.rank == 0
        for layer in model.layers:
            layer.attention.wo = AllReduced(layer.attention.wo, name, first)
            layer.feed_forward.w2 = AllReduced(layer.feed_forward.w2, name, first)
            if layer.row_kernels is FusedRow:
                layer.row_kernels = ParallelRow
        if shards_head(config, self.size):
            model.output = AllGathered(model.output, name, self.size)

    def gather(self, value: object) -> list[object]:
        """Every rank's ``value`` (a small picklable object), in rank order."""
        import torch.distributed as dist

        values: list[object] = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def check_same_tokens(self, tokens: list[list[int]]) -> None:
        """Every rank must have drawn the same tokens (they sample from the same logits with the same seed):
        checked once per generation."""
        if len({repr(t) for t in self.gather(tokens)}) != 1:
            raise RuntimeError("tensor-parallel ranks generated different tokens (were they seeded differently?)")


def device_of(device: torch.device, ranks: Ranks | None) -> torch.device:
    """The device a rank computes on: its host's GPU number ``LOCAL_RANK`` (never the global rank, which counts
    the GPUs of every host), or the CPU; ``device`` as it is outside torchrun (the ranks are not started yet)."""
    if device.type != "cuda":
        return device
    if device.index is not None:
        raise ValueError(f"--device {device}: with tensor parallelism each rank uses the GPU of its LOCAL_RANK (cuda)")
    if ranks is None:
        return device
    count = torch.cuda.device_count()
    if ranks.local_rank >= count:
        raise ValueError(f"LOCAL_RANK={ranks.local_rank}, but this host has {count} GPU(s): start at most {count} here")
    return torch.device("cuda", ranks.local_rank)


def leave() -> None:
    """Leave the group at exit (a process that ends without it may abort while its communicator's threads run).

    The group must be unreferenced then, so that destroying it joins its backend's threads here, at exit, while the
    interpreter is whole: a group still held (by a compiled graph, by a default argument: :func:`join`) is destroyed
    only in the interpreter's finalization, where a gloo rank sometimes aborts ("terminate called without an active
    exception") after its work is done.

    A CUDA graph that captured a collective holds a reference on NCCL's communicator, and destroying the
    communicator waits until every such graph is gone (pytorch/pytorch#115388): with `reduce-overhead` the ranks
    hung here for ever. So the compiled state, which keeps the graphs, is released first."""
    import torch.distributed as dist

    if dist.is_initialized():
        torch.compiler.reset()
        gc.collect()
        dist.destroy_process_group()


def join(size: int, device: torch.device) -> TensorParallel:
    """Join the group of ``size`` ranks that ``torchrun`` started (or the one already initialised), on ``device``
    (from :func:`device_of`); every rank then takes rank 0's random seed, so that sampling draws the same tokens
    everywhere."""
    import torch.distributed as dist

    ranks = env_ranks()
    if ranks is None or ranks.world_size != size:
        found = "outside torchrun" if ranks is None else f"with WORLD_SIZE={ranks.world_size}"
        raise OptionError(
            f"tp {size} runs as {size} processes: start them with `torchrun --nproc_per_node {size} -m gpt_fast "
            f"generate ...` or `gpt-fast generate --tp {size} ...` (this process runs {found})",
            "tp",
        )
    if not dist.is_initialized():
        # its collectives take the group made here as their default argument if it is imported after (Dynamo imports
        # it when it first compiles), and would keep the group past leave()
        importlib.import_module("torch.distributed.nn.functional")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        atexit.register(leave)
    parallel = TensorParallel(ranks, dist.group.WORLD)
    seed = [torch.initial_seed()]
    dist.broadcast_object_list(seed, src=0)
    torch.manual_seed(seed[0])
    return parallel
