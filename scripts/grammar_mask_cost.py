"""The per-token cost of a grammar engine's token mask on a checkpoint's vocabulary (default: the embedded default
model, SmolLM2-135M-Instruct, 49152 tokens): llguidance, xgrammar and outlines-core, each where it is importable.

For each JSON schema below, the engine reads the vocabulary (each token's bytes, :attr:`Tokenizer.token_bytes`),
compiles the schema (a matcher made), then walks the tokens of a document that matches it (the tokenizer's own
encoding of the document, then the stop token): at each token it fills a bitmask of the allowed tokens (one bit per
token, what gpt-fast copies to the device) and advances by the token. Printed: the vocabulary's set-up, the schema's
compile (up to a first matcher), and the mean microseconds per token of the mask and of the advance, the median of
``--repeats`` walks (each with a fresh matcher of the compiled schema).

    .venv/bin/python scripts/grammar_mask_cost.py [--checkpoint_path DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gpt_fast import Engine
from gpt_fast.text.tokenizer import Tokenizer

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "json_object": ({"type": "object"}, {"name": "Ada", "tags": ["x", "y"], "n": 3}),
    "person (nested, enum, array, bounds)": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "role": {"enum": ["engineer", "scientist", "artist"]},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
                "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 4},
            },
            "required": ["name", "age", "role", "address", "scores"],
            "additionalProperties": False,
        },
        {
            "name": "Grace Hopper",
            "age": 85,
            "role": "scientist",
            "address": {"city": "Arlington", "zip": "22201"},
            "scores": [0.5, 0.75, 1],
        },
    ),
}


# The JSON every engine writes here: json.dumps's separators, no other whitespace (the documents are json.dumps's).
SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Walk:
    """One engine's matcher over one schema: ``mask(bitmask)`` fills the allowed tokens, ``advance(token)``."""

    mask: Callable[[torch.Tensor], None]
    advance: Callable[[int], None]


# seconds to read the vocabulary, and a schema's compile, which gives fresh walks of it
Setup = tuple[float, Callable[[dict], Callable[[], Walk]]]


def llguidance_engine(tokenizer: Tokenizer, vocab: list[bytes], control: list[int], stop: int) -> Setup:
    import llguidance
    import llguidance.torch  # its import compiles a function: before the clock starts

    class Wrapped:
        eos_token_id, bos_token_id, tokens, special_token_ids = stop, None, vocab, control

        def __call__(self, text: bytes) -> list[int]:
            return tokenizer.encode(text.decode(), bos=False)

    start = time.perf_counter()
    engine_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))
    setup = time.perf_counter() - start

    def compile_schema(schema: dict) -> Callable[[], Walk]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, SEPARATORS)
        return lambda: walk_of(llguidance.LLMatcher(engine_tokenizer, grammar))

    def walk_of(matcher: llguidance.LLMatcher) -> Walk:
        walk = Walk()
        walk.mask = lambda bitmask: llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        walk.advance = lambda token: _check(matcher.consume_token(token), matcher.get_error())
        return walk

    return setup, compile_schema


def xgrammar_engine(tokenizer: Tokenizer, vocab: list[bytes], control: list[int], stop: int) -> Setup:
    import xgrammar

    start = time.perf_counter()
    words = [b"" if i in set(control) else piece for i, piece in enumerate(vocab)]  # "" marks a special token
    info = xgrammar.TokenizerInfo(words, xgrammar.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[stop])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start

    def compile_schema(schema: dict) -> Callable[[], Walk]:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return lambda: walk_of(xgrammar.GrammarMatcher(compiled))

    def walk_of(matcher: xgrammar.GrammarMatcher) -> Walk:
        walk = Walk()
        walk.mask = lambda bitmask: matcher.fill_next_token_bitmask(bitmask)
        walk.advance = lambda token: _check(matcher.accept_token(token), "token refused")
        return walk

    return setup, compile_schema


def outlines_engine(tokenizer: Tokenizer, vocab: list[bytes], control: list[int], stop: int) -> Setup:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    skipped = set(control)
    pieces: dict[bytes, list[int]] = {}
    for i, piece in enumerate(vocab):
        if i not in skipped and piece:
            pieces.setdefault(piece, []).append(i)
    vocabulary = outlines_core.Vocabulary(stop, pieces)
    setup = time.perf_counter() - start

    def compile_schema(schema: dict) -> Callable[[], Walk]:
        index = outlines_core.Index(build_regex_from_schema(json.dumps(schema), " ?"), vocabulary)
        return lambda: walk_of(outlines_core.Guide(index))

    def walk_of(guide: outlines_core.Guide) -> Walk:
        walk = Walk()
        walk.mask = lambda bitmask: guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())
        walk.advance = lambda token: None if token == stop and guide.is_finished() else guide.advance(token)
        return walk

    return setup, compile_schema


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_engine}


def _check(ok: bool, error: str) -> None:
    if not ok:
        raise RuntimeError(f"the engine refused a token of the document: {error}")


def measure(
    compile_schema: Callable[[dict], Callable[[], Walk]], schema: dict, tokens: list[int], vocab_size: int, repeats: int
):
    """The compile's seconds (up to a matcher) and the median per-token mask and advance microseconds."""
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    start = time.perf_counter()
    fresh = compile_schema(schema)
    walk = fresh()
    compiled = time.perf_counter() - start
    masks, advances = [], []
    for _ in range(repeats):
        mask_seconds = advance_seconds = 0.0
        for token in tokens:
            start = time.perf_counter()
            walk.mask(bitmask)
            middle = time.perf_counter()
            walk.advance(token)
            mask_seconds += middle - start
            advance_seconds += time.perf_counter() - middle
        masks.append(mask_seconds / len(tokens) * 1e6)
        advances.append(advance_seconds / len(tokens) * 1e6)
        walk = fresh()
    return compiled, statistics.median(masks), statistics.median(advances)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_path", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = Engine.open(args.checkpoint_path).tokenizer
    vocab, control, stop = list(tokenizer.token_bytes), sorted(tokenizer.control_ids), tokenizer.stop_ids[0]
    print(f"vocabulary: {len(vocab)} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| engine | schema | tokens | vocabulary set-up s | compile ms | mask µs/token | advance µs/token |")
    print("|---|---|---|---|---|---|---|")
    for name, make in ENGINES.items():
        try:
            setup, compile_schema = make(tokenizer, vocab, control, stop)
        except ImportError:
            print(f"| {name} | not installed | | | | | |")
            continue
        for label, (schema, document) in SCHEMAS.items():
            tokens = [*tokenizer.encode(json.dumps(document), bos=False), stop]
            first, mask, advance = measure(compile_schema, schema, tokens, len(vocab), args.repeats)
            print(
                f"| {name} | {label} | {len(tokens)} | {setup:.2f} | {first * 1e3:.1f} | {mask:.1f} | {advance:.1f} |"
            )


if __name__ == "__main__":
    main()
