"""Builders for tiny checkpoints used across the tests (random weights, built in seconds), and torch on one thread
while they run (:func:`one_torch_thread`)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gpt_fast.generation.loop import Readbacks

CORPUS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello, my name is Ada and I like numbers like 12345 and 3.14159.",
    "Tabs\tand  spaces   and newlines\n\nare text too; émoji 🙂 and ünïcode.",
] * 20

BOS, EOS = "<s>", "</s>"


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread meanwhile: tiny models gain nothing from threads, and on a busy machine two threads wait
    on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_bpe_tokenizer(folder: Path, vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE tokenizer.json (+ tokenizer_config.json) whose post-processor prepends BOS, as Llama 3's "
    "does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS})
    )
    return tokenizer


def hf_llama_config(
    vocab_size: int, *, kv_heads: int = 2, tie: bool = False, rope_scaling: dict | None = None, layers: int = 2
):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_scaling=rope_scaling,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
    )


def save_hf_llama(
    folder: Path,
    *,
    kv_heads: int = 2,
    tie: bool = False,
    rope_scaling: dict | None = None,
    weights: str = "safetensors",
    seed: int = 0,
):
    """A tiny random LlamaForCausalLM saved with save_pretrained: weights = safetensors | sharded | bin.

    transformers 5 only writes safetensors, so the legacy ``pytorch_model.bin`` is written with torch.save,
    as older transformers did."""
    tokenizer = train_bpe_tokenizer(folder)
    model = random_llama(
        hf_llama_config(tokenizer.get_vocab_size(), kv_heads=kv_heads, tie=tie, rope_scaling=rope_scaling), seed
    )
    model.save_pretrained(folder, max_shard_size="60KB" if weights == "sharded" else "5GB")
    if weights == "bin":
        (folder / "model.safetensors").unlink()
        state = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
        torch.save(state, folder / "pytorch_model.bin")
    return model


def torch_archive(path: Path, data_pkl: bytes, records: dict[str, bytes] | None = None, compression: int = 0) -> Path:
    """A zip archive laid out as ``torch.save`` writes one, holding ``data_pkl`` as its pickle and ``records``
    (storage key -> bytes) as its data, stored with ``compression`` (a zipfile constant): for building broken
    and hostile weights files."""
    template = io.BytesIO()
    torch.save({}, template)
    with zipfile.ZipFile(template) as source, zipfile.ZipFile(path, "w") as out:
        prefix = source.namelist()[0].partition("/")[0]
        for info in source.infolist():
            out.writestr(info.filename, data_pkl if info.filename.endswith("/data.pkl") else source.read(info))
        for key, data in (records or {}).items():
            out.writestr(f"{prefix}/data/{key}", data, compress_type=compression)
    return path


class _Storage:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    """Pickles as a float32 tensor of ``shape`` on a storage of ``numel`` elements, whatever its shape needs."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        strides = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, self.shape, strides, False, OrderedDict())


def tensor_pickle(tensors: dict, storage_numel: int) -> bytes:
    """The pickle ``torch.save`` would write for ``tensors`` (name -> shape), each on its own float32 storage
    (keys "0", "1", ...) declared to hold ``storage_numel`` elements."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _Storage):
                return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
            return None

    buffer = io.BytesIO()
    state = {name: _Tensor(_Storage(str(i), storage_numel), shape) for i, (name, shape) in enumerate(tensors.items())}
    Pickler(buffer, protocol=2).dump(state)
    return buffer.getvalue()


def random_llama(config, seed: int = 0):
    """A LlamaForCausalLM with random weights larger than the default init: well-separated logits, no argmax
    near-ties."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith("norm.weight")
            p.normal_(1.0 if norm else 0.0, 0.1 if norm else 0.25)
    return model


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``, with no stop token."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def our_greedy(engine, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Our greedy continuation of ``prompt`` through the engine's API, with no stop token."""
    from gpt_fast.generation.sampling import SamplingConfig

    return engine.generate_ids(prompt, max_new_tokens, SamplingConfig(temperature=0), ignore_eos=True).tokens[0]


class LaggingEvent:
    """A step's copies, on their way as on a GPU: done once a later step is launched, or once waited for."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class LaggingReadbacks(Readbacks):
    """Each step's results reach the host only after the next step is launched: the host runs ahead as on a GPU."""

    def push(self, tensors, tag=None) -> None:
        for record in self.queue:
            record.event.done = True
        super().push(tensors, tag)
        self.queue[-1].event = LaggingEvent()
