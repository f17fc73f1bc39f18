"""Running the server: bind the socket (before any weights are read, so that a port in use is refused at once), load
and warm the engine up, then serve: the batcher steps in the main thread, the one that compiled and warmed up the
steps (in the CUDA-graph modes torch 2.11 keeps its CUDA-graph trees for that thread only), and uvicorn runs the app
in a thread of its own until Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence

import uvicorn

from gpt_fast.engine.batcher import Batcher
from gpt_fast.engine.engine import Engine
from gpt_fast.engine.options import BatchOptions
from gpt_fast.serve.app import OpenAIServer
from gpt_fast.serve.openai_api import Context
from gpt_fast.serve.options import ServeOptions

SHUTDOWN_SECONDS = 5
Write = Callable[[str], None]


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (port 0: any free one)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def serve(engine: Engine, options: ServeOptions, write: Write) -> None:
    """Serve ``engine`` (opened, weights not yet read) until interrupted."""
    batch_options = options.batch_options(engine.model_config.block_size)
    sock = listen(options.host, options.port)
    try:
        host, port = sock.getsockname()[:2]
        batcher = warmed_up_batcher(engine, batch_options, write)
        model_id = options.model_name or engine.checkpoint_dir.name
        server = http_server(engine, batcher, model_id, options.api_key, write)

        def stop_server() -> None:
            server.should_exit = True

        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        write(
            f"Serving {model_id} at {url}/ (OpenAI API at {url}/v1, chat page at {url}/): {batch_options.max_batch} "
            f"slots of {batcher.max_seq_length} tokens, {batch_options.max_queue} more may wait; Ctrl-C stops\n"
        )
        write(f"KV cache: {describe_cache(batcher)}\n")
        with signals_call(batcher.close):  # the requests in flight end (failed), then the server stops
            batcher.serve_while(lambda: server.run(sockets=[sock]), stop=stop_server, timeout=SHUTDOWN_SECONDS + 1)
    finally:
        sock.close()


def http_server(engine: Engine, batcher: Batcher, model_id: str, api_key: str | None, write: Write) -> uvicorn.Server:
    """The app on uvicorn, to be run in a thread of its own (where it leaves the signals to the main thread)."""
    tokenizer = engine.tokenizer
    ctx = Context(
        model_id,
        batcher.max_seq_length,
        engine.model_config.vocab_size,
        engine.encode,
        engine.chat_ids if engine.chat_template else None,
        tokenize=lambda text, special: tokenizer.encode(text, bos=special),
        detokenize=tokenizer.decode,
        tool_marker=tool_marker(engine),
        tool_constraint=engine.tool_call_constraint,
        parse_tool_calls=lambda ids, names: parsed_calls(engine, ids, names),
    )
    app = OpenAIServer(batcher, ctx, api_key, log=lambda line: write(line + "\n")).app()
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_SECONDS
    )
    return uvicorn.Server(config)


def tool_marker(engine: Engine) -> str | None:
    """The text that opens the model's tool calls as its answer's stream shows it (special tokens left out); None if
    its chat template writes no tool calls."""
    layout = engine.tool_call_format
    if layout is None:
        return None
    return engine.decode(engine.tokenizer.encode(layout.start.strip(), bos=False)).strip()


def parsed_calls(engine: Engine, ids: Sequence[int], names: Collection[str]) -> tuple[str, list[tuple[str, str]]]:
    """The text before the calls an answer makes, and each call's function name and arguments (JSON text)."""
    content, calls = engine.parse_tool_calls(ids, names)
    return content, [(call.name, call.arguments) for call in calls]


def describe_cache(batcher: Batcher) -> str:
    """The cache's size, in blocks (or rows), tokens and memory, and its dtype."""
    usage, caches = batcher.cache_usage(), [layer.attention.kv_cache.kv for layer in batcher.model.layers]
    gib = sum(kv.numel() * kv.element_size() for kv in caches) / 2**30
    dtype = str(caches[0].dtype).removeprefix("torch.")
    size = f"{usage.blocks * usage.block_size} tokens, {gib:.2f} GiB of {dtype}"
    if batcher.allocator is None:
        return f"static, {usage.blocks} rows of {usage.block_size} tokens ({size})"
    return f"paged, {usage.blocks} blocks of {usage.block_size} tokens ({size}), prefix caching on"


def warmed_up_batcher(engine: Engine, batch_options: BatchOptions, write: Write) -> Batcher:
    """Read the weights, and make the batcher and warm its steps up in this thread, the one that will drive it: the
    plain steps and the masked ones of constrained requests (so that the first such request compiles nothing)."""
    write(f"Using device={engine.device} ({engine.device_name}), dtype={engine.dtype_name}, compile={engine.compile}\n")
    engine.load_weights()
    write(f"Time to load model: {engine.load_seconds:.2f} seconds\n")
    batcher = engine.batcher(batch_options)
    start = time.perf_counter()
    batcher.warm_up(constrained=True)
    seconds = time.perf_counter() - start
    sizes = ", ".join(map(str, batcher.step_rows))
    slots = f"the steps for {sizes} slots, plain and constrained, compiled if asked"
    if batcher.row_prefills is not None and batcher.row_prefills.graphs:
        slots += f"; {len(batcher.row_prefills.graphs)} shapes of prompts prefilled together, in CUDA graphs"
    write(f"Warm-up ({slots}): {seconds:.2f} seconds\n")
    return batcher


@contextlib.contextmanager
def signals_call(stop: Callable[[], None]) -> Iterator[None]:
    """Inside the block, SIGINT (Ctrl-C) and SIGTERM call ``stop`` instead of interrupting what runs (a second Ctrl-C
    does interrupt); after it, the signal is raised again, so that the process ends as it would have (status 130
    after Ctrl-C). Only the main thread handles signals: in another, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handle(sig: int, frame: object) -> None:
        if received and sig == signal.SIGINT:
            raise KeyboardInterrupt
        received.append(sig)
        stop()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for sig in received[:1]:
        signal.raise_signal(sig)
