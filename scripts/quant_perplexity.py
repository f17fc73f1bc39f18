"""The accuracy side of quantization in one invocation: a float checkpoint (default: the default model) quantized
in each scheme, then for each, perplexity on the default text (``pydoc_data.topics``, as ``gpt-fast eval``
computes it) with its change from the float checkpoint, and greedy answers to a few chat prompts side by side.

A scheme's name says it all: ``int4-g128-gptq-ao`` is int4 in groups of 128 rounded by GPTQ with act-order,
calibrated on the default calibration text (standard-library docstrings, never the evaluation text; see
:mod:`gpt_fast.quant.calibrate`); ``int4-g128-gptq-asym-ao`` the same with asymmetric calibration;
``int4-g64-gptq-asym-ao`` is what ``gpt-fast quantize --mode int4`` does with no other option.

With ``--gguf FILE`` an extra row converts that GGUF file straight to int4 in groups of 32 (its Q4_0/Q4_1 blocks
taken over as they are, :mod:`gpt_fast.convert.gguf_quant`): for the default model, whose source is a Q4_1 GGUF,
that row is the original 4-bit model.

    python scripts/quant_perplexity.py [--device cuda --dtype bfloat16] [--gguf .../SmolLM2-135M-Instruct.Q4_1.gguf]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from gpt_fast.convert.gguf_file import convert_gguf
from gpt_fast.convert.quantize import quantize_checkpoint
from gpt_fast.engine.engine import Engine, EngineOptions, find_checkpoint
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.jobs.evaluate import default_text, perplexity
from gpt_fast.model.config import QuantConfig
from gpt_fast.quant.calibrate import DEFAULT_TOKENS, Calibration
from gpt_fast.util.fileio import write_text_atomic
from gpt_fast.util.settings import apply_torch_settings

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give three tips for staying healthy.",
]
SCHEMES = "int8,int4-g128,int4-g64,int4-g32,int4-g128-gptq-ao,int4-g128-gptq-asym-ao,int4-g64-gptq-asym-ao"


def parse_scheme(name: str, tokens: int) -> tuple[QuantConfig, Calibration | None]:
    """``int8``, ``int4-g128``, then any of ``-gptq`` (calibrated on the default calibration text, ``tokens`` of
    it), ``-asym`` (asymmetric calibration), ``-ao`` (act-order) and ``-output`` (the output projection too), in
    that order."""
    output = name.endswith("-output")
    name = name.removesuffix("-output")
    act_order = name.endswith("-ao")
    name = name.removesuffix("-ao")
    asymmetric = name.endswith("-asym")
    name = name.removesuffix("-asym")
    gptq = name.endswith("-gptq")
    mode, _, group = name.removesuffix("-gptq").partition("-g")
    quant = QuantConfig(mode, int(group) if group else None, output, method="gptq" if gptq else "rtn")
    return quant, Calibration(tokens=tokens, act_order=act_order, asymmetric=asymmetric) if gptq else None


def build(args: argparse.Namespace, source: Path, work: Path) -> dict[str, Path]:
    """The checkpoint of each row: the source itself first."""
    folders = {"float": source}
    for name in args.schemes.split(","):
        start = time.perf_counter()
        quant, calibration = parse_scheme(name, args.calibration_tokens)
        quantize_checkpoint(source, work / name, quant, args.quantize_device, calibration)
        print(f"quantized {name} in {time.perf_counter() - start:.1f} s")
        folders[name] = work / name
    if args.gguf is not None:
        convert_gguf(args.gguf, work / "gguf-int4-g32", quantization=QuantConfig("int4", 32))
        folders["int4-g32 from the GGUF's Q4 blocks"] = work / "gguf-int4-g32"
    return folders


def evaluate(folder: Path, args: argparse.Namespace) -> dict:
    engine = Engine.load(folder, device=args.device, dtype=args.dtype)
    ids = engine.encode(default_text())[: args.max_tokens]
    result = perplexity(engine, ids, args.window, args.stride)
    answers = [
        c.text.strip()
        for c in engine.generate(
            PROMPTS, args.new_tokens, SamplingConfig(temperature=0), chat=engine.chat_template is not None
        )
    ]
    return {"perplexity": result.perplexity, "tokens": result.tokens, "seconds": result.seconds, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_path", default=None, help="A float checkpoint (default: the default model).")
    parser.add_argument("--gguf", type=Path, default=None, help="Also convert this GGUF straight to int4-g32.")
    parser.add_argument("--schemes", default=SCHEMES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize_device", default="cpu")
    parser.add_argument("--calibration_tokens", type=int, default=DEFAULT_TOKENS, help="For the -gptq schemes.")
    parser.add_argument("--max_tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--new_tokens", type=int, default=40)
    parser.add_argument("--json_out", type=Path, default=None)
    args = parser.parse_args()
    EngineOptions(device=args.device, dtype=args.dtype)  # checks them before any work
    apply_torch_settings()
    source = find_checkpoint(args.checkpoint_path)
    with tempfile.TemporaryDirectory(prefix="quant-ppl-") as work:
        rows = {name: evaluate(folder, args) for name, folder in build(args, source, Path(work)).items()}
    base = rows["float"]["perplexity"]
    print(
        f"\n{source}, {args.device} {args.dtype}, pydoc_data.topics, {rows['float']['tokens']} tokens scored, "
        f"window {args.window}, stride {args.stride}\n"
    )
    print("| scheme | perplexity | vs float | seconds |\n|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['perplexity']:.4f} | {100 * (row['perplexity'] / base - 1):+.2f} % | "
            f"{row['seconds']:.1f} |"
        )
    for i, prompt in enumerate(PROMPTS):
        print(f"\n**{prompt}**\n\n| scheme | greedy answer ({args.new_tokens} tokens at most) |\n|---|---|")
        for name, row in rows.items():
            print(f"| {name} | {row['answers'][i].replace(chr(10), ' ').replace('|', '/')} |")
    if args.json_out is not None:
        write_text_atomic(args.json_out, json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
