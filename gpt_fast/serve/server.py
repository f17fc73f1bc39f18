"""Running the server: bind the socket (before any weights are read, so that a port in use is refused at once), load
and warm the engine up, start the batcher's thread, and serve the app with uvicorn until interrupted."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from gpt_fast.batching import BatchOptions
from gpt_fast.engine import Engine
from gpt_fast.serve.app import OpenAIServer
from gpt_fast.serve.openai_api import Context

DEFAULT_CONTEXT = 2048  # tokens per slot unless --max_seq_length says otherwise (or the model's context is shorter)
SHUTDOWN_SECONDS = 5
Write = Callable[[str], None]


@dataclass(frozen=True)
class ServeOptions:
    """`gpt-fast serve`'s options besides the checkpoint and the engine's."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_seq_length: int | None = None  # None: the model's context, at most DEFAULT_CONTEXT
    max_queue: int = 64
    api_key: str | None = None
    model_name: str | None = None  # None: the checkpoint folder's name

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api_key is empty")
        if self.model_name is not None and not self.model_name.strip():
            raise ValueError("--model_name is empty")
        BatchOptions(self.max_batch, self.max_seq_length, self.max_queue)

    def batch_options(self, block_size: int) -> BatchOptions:
        if self.max_seq_length is not None and self.max_seq_length > block_size:
            raise ValueError(f"--max_seq_length {self.max_seq_length} exceeds the model's context of {block_size}")
        return BatchOptions(self.max_batch, self.max_seq_length or min(block_size, DEFAULT_CONTEXT), self.max_queue)


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
    host, port = sock.getsockname()[:2]
    write(f"Using device={engine.device} ({engine.device_name}), dtype={engine.dtype_name}, compile={engine.compile}\n")
    engine.load_weights()
    write(f"Time to load model: {engine.load_seconds:.2f} seconds\n")
    batcher = engine.batcher(batch_options)
    start = time.perf_counter()
    thread = batcher.serve_in_thread()
    seconds = time.perf_counter() - start
    write(f"Warm-up (the steps for 1 and {batch_options.max_batch} slots, compiled if asked): {seconds:.2f} seconds\n")
    model_id = options.model_name or engine.checkpoint_dir.name
    chat_ids = engine.chat_ids if engine.chat_template else None
    ctx = Context(model_id, batcher.max_seq_length, engine.model_config.vocab_size, engine.encode, chat_ids)
    app = OpenAIServer(batcher, ctx, options.api_key).app()
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_SECONDS
    )
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    write(
        f"Serving {model_id} at {url}/ (OpenAI API at {url}/v1, chat page at {url}/): {batch_options.max_batch} "
        f"slots of {batcher.max_seq_length} tokens, {batch_options.max_queue} more may wait; Ctrl-C stops\n"
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        batcher.close()
        thread.join(timeout=SHUTDOWN_SECONDS)
        sock.close()
