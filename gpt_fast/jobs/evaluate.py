"""`gpt-fast eval`: perplexity of a checkpoint on a text, with a sliding window.

The text is encoded once (BOS first, as the checkpoint's tokenizer says) and cut to ``max_tokens``. Windows of
``window`` tokens start every ``stride`` tokens; each scores only the tokens no earlier window scored, so that
every token but the first is scored exactly once, with at least ``window - stride`` tokens of context once the
first window is past (the method of the Hugging Face guide "Perplexity of fixed-length models"). The perplexity
is ``exp`` of the mean negative log-likelihood of the scored tokens.

The default text needs no download: Python's own documentation topics (``pydoc_data.topics``, the text
``help('assert')`` shows, shipped with every CPython), joined in the order of their names. ``--dataset
wikitext-2`` reads the test split of WikiText-2 (raw) from the Hugging Face hub, joined with blank lines as
the Hugging Face guide does.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from gpt_fast.engine.engine import Engine
from gpt_fast.jobs.options import EvalOptions
from gpt_fast.util.device import dtype_name

WIKITEXT_REPO = "Salesforce/wikitext"
WIKITEXT_TEST = "wikitext-2-raw-v1/test-00000-of-00001.parquet"
Write = Callable[[str], None]


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    tokens: int  # tokens scored (the text's tokens but the first)
    nll: float  # mean negative log-likelihood per scored token, in nats
    windows: int
    window: int
    stride: int
    seconds: float


def default_text() -> str:
    """Python's documentation topics, in the order of their names."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def wikitext2_text() -> str:
    """The WikiText-2 (raw) test split from the Hugging Face hub (or its local cache), lines joined by blank lines."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from gpt_fast.util.download import check_reachable, hub_error, is_offline, quiet_hub, transport_errors

    where = f"--dataset wikitext-2 ({WIKITEXT_REPO}, {WIKITEXT_TEST})"
    with quiet_hub():
        try:
            path = hf_hub_download(WIKITEXT_REPO, WIKITEXT_TEST, repo_type="dataset", local_files_only=True)
        except LocalEntryNotFoundError:
            if is_offline():
                raise FileNotFoundError(f"{where}: offline and not in the local Hugging Face cache") from None
            check_reachable_for(where, check_reachable)
            try:
                path = hf_hub_download(WIKITEXT_REPO, WIKITEXT_TEST, repo_type="dataset")
            except (HfHubHTTPError, *transport_errors()) as err:
                raise hub_error(err, WIKITEXT_REPO, None) from err
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ValueError(f"{where} is a Parquet file: reading it needs pyarrow (pip install pyarrow)") from None
    return "\n\n".join(parquet.read_table(path, columns=["text"]).column("text").to_pylist())


def check_reachable_for(where: str, check: Callable[[str], None]) -> None:
    from huggingface_hub import constants

    try:
        check(constants.ENDPOINT)
    except ConnectionError as err:
        raise ConnectionError(f"{where}: {str(err).split(';')[0]}; without the hub, use --text FILE") from None


def builtin_text(options: EvalOptions) -> str:
    """The text of ``--dataset``, or the default text."""
    return wikitext2_text() if options.dataset == "wikitext-2" else default_text()


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, scored)`` of each window over ``n_tokens`` tokens: the window is ``ids[begin:end]`` and its
    last ``scored`` tokens are scored: those no earlier window scored, never a window's first token (it has no
    context in the window; with ``stride == window`` these tokens go unscored)."""
    spans = []
    scored_until = 1
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + window, n_tokens)
        spans.append((begin, end, min(end - scored_until, end - begin - 1)))
        scored_until = end
        if end == n_tokens:
            break
    return spans


def perplexity(engine: Engine, ids: list[int], window: int, stride: int, progress: Write | None = None) -> Perplexity:
    """Sliding-window perplexity of ``ids`` (see the module's docstring)."""
    spans = windows(len(ids), window, stride)
    start = time.perf_counter()
    total, count = 0.0, 0
    for i, (begin, end, scored) in enumerate(spans):
        log_likelihoods = engine.log_likelihoods(ids[begin:end])[-scored:]
        total -= log_likelihoods.double().sum().item()
        count += scored
        if progress is not None:
            progress(f"window {i + 1}/{len(spans)}: perplexity so far {math.exp(total / count):.4f}\n")
    nll = total / count
    return Perplexity(math.exp(nll), count, nll, len(spans), window, stride, time.perf_counter() - start)


def run_eval(
    engine: Engine, options: EvalOptions, text: str, as_json: bool, write: Write, progress: Write
) -> Perplexity:
    """Encode ``text``, load the weights, score; the result as a table or a JSON object."""
    window, stride = options.spans(engine.model_config.block_size)
    ids = engine.encode(text)[: options.max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{options.text_name} encodes to fewer than 2 tokens")
    engine.load_weights()
    with torch.inference_mode():
        result = perplexity(engine, ids, window, stride, progress)
    quant = engine.quantization.name if engine.quantization is not None else "none"
    facts = {
        "checkpoint": str(engine.checkpoint_dir),
        "quantization": quant,
        "device": engine.device_name,
        "dtype": engine.dtype_name,
        "kv_cache_dtype": dtype_name(engine.kv_dtype),
        "text": options.text_name,
    }
    if as_json:
        write(json.dumps(facts | asdict(result), indent=2) + "\n")
    else:
        write(table(facts, result))
    return result


def table(facts: dict[str, str], result: Perplexity) -> str:
    header = [*facts, "tokens", "window", "stride", "perplexity", "seconds"]
    cells = [*facts.values(), result.tokens, result.window, result.stride, f"{result.perplexity:.4f}"]
    cells.append(f"{result.seconds:.1f}")
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), "| " + " | ".join(map(str, cells)) + " |", ""]
    )
