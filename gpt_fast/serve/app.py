"""The Starlette application: the OpenAI endpoints, vLLM's ``/tokenize`` and ``/detokenize``, the health check, the
Prometheus metrics (:mod:`gpt_fast.serve.metrics`) and the chat page.

Each request is checked (:mod:`gpt_fast.serve.openai_api`), submitted to the batcher, and answered from its events:
as one JSON object, or as server-sent events ending in ``data: [DONE]``. A client that goes away cancels its
request, which frees its slot at the batcher's next step. Every error, 404 and 405 included, is OpenAI's error
object.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gpt_fast.engine.batcher import Batcher, Delta, Failed, Finished, Job, PromptLogprobs, QueueFull, TokenLogprob
from gpt_fast.generation.constraint import GrammarError
from gpt_fast.serve.errors import APIError
from gpt_fast.serve.metrics import ServerMetrics
from gpt_fast.serve.openai_api import Call, Context, Responder, detokenize, parse_chat, parse_completion, tokenize
from gpt_fast.serve.sse import DONE, Bridge, EventStream, event
from gpt_fast.serve.structured import ToolStream, tool_finish

MAX_BODY_BYTES = 4 << 20
PAGE = Path(__file__).resolve().parent / "static" / "index.html"


class OpenAIServer:
    """The endpoints over one batcher. ``log`` gets one line for each field of :data:`IGNORED_FIELDS
    <gpt_fast.serve.openai_api.IGNORED_FIELDS>` the first time a request gives it."""

    def __init__(
        self, batcher: Batcher, ctx: Context, api_key: str | None = None, log: Callable[[str], None] = print
    ) -> None:
        self.batcher, self.ctx, self.api_key, self.log = batcher, ctx, api_key, log
        self.created = int(time.time())
        self.page = PAGE.read_bytes()
        self.ignored_seen: set[str] = set()
        self.metrics = ServerMetrics(batcher)

    def app(self) -> Starlette:
        routes = [
            Route("/", self.chat_page),
            Route("/health", self.health),
            Route("/metrics", self.scrape),
            Route("/v1/models", self.models),
            Route("/v1/models/{model:path}", self.model),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]
        handlers = {APIError: api_error, HTTPException: http_error, Exception: internal_error}
        return Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]

    async def chat_page(self, request: Request) -> Response:
        return HTMLResponse(self.page)

    async def health(self, request: Request) -> Response:
        batcher = self.batcher
        if "reset_peak" in request.query_params:  # the cache's peak counted from this reading on
            batcher.reset_peak()
        return JSONResponse(
            {
                "status": "ok",
                "model": self.ctx.model_id,
                "slots": batcher.options.max_batch,
                "busy": batcher.busy,
                "waiting": batcher.queued,
                "tokens_generated": batcher.tokens_generated,
                "cache": asdict(batcher.cache_usage()),
            }
        )

    async def scrape(self, request: Request) -> Response:
        self.authorize(request)
        body, content_type = self.metrics.exposition(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.ctx.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "gpt-fast",
            "max_model_len": self.ctx.max_seq_length,
        }

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        name = request.path_params["model"]
        if name != self.ctx.model_id:
            raise APIError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")
        return JSONResponse(self.model_card())

    async def chat(self, request: Request) -> Response:
        self.authorize(request)
        return await self.answer(request, parse_chat(await read_json(request), self.ctx))

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        return await self.answer(request, parse_completion(await read_json(request), self.ctx))

    async def tokenize(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse(tokenize(await read_json(request), self.ctx))

    async def detokenize(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse(detokenize(await read_json(request), self.ctx))

    def authorize(self, request: Request) -> None:
        """With an API key set, every request but the health check and the page (/v1, /tokenize, /detokenize,
        /metrics) carries it as ``Authorization: Bearer KEY``."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "You didn't provide an API key (Authorization: Bearer KEY)", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    async def answer(self, request: Request, call: Call) -> Response:
        self.log_ignored(call.ignored)
        bridge = Bridge(asyncio.get_running_loop())
        if any(choice.constraint is not None for choice in call.requests):  # compiled off the event loop
            jobs = await asyncio.to_thread(self.submit, call, bridge)
        else:
            jobs = self.submit(call, bridge)

        def cancel() -> None:
            for job in jobs:
                self.batcher.cancel(job)

        responder = Responder(call, self.ctx.model_id, self.ctx.parse_tool_calls)
        if call.stream:
            return EventStream(stream(call, responder, bridge, self.ctx.tool_marker or ""), on_close=cancel)
        try:
            ends = await until_disconnected(request, collect(bridge, len(jobs), call.constraint_param))
        finally:
            cancel()
        if ends is None:  # the client has gone: nobody reads the answer
            return Response(status_code=499)
        return JSONResponse(responder.response(ends))

    def submit(self, call: Call, bridge: Bridge) -> list[Job]:
        """Submit each request of ``call``, its events tagged with its choice's index; none if one is refused."""
        jobs: list[Job] = []
        try:
            for index, choice in enumerate(call.requests):
                on_event = self.metrics.observe(len(choice.prompt_ids), functools.partial(bridge.put, index))
                jobs.append(self.batcher.submit(choice, on_event))
        except (QueueFull, ValueError) as err:
            for job in jobs:
                self.batcher.cancel(job)
            if isinstance(err, GrammarError):  # the constraint the engine refuses, named by its field
                raise APIError(400, f"{call.constraint_param}: {err}", param=call.constraint_param) from None
            if isinstance(err, ValueError):
                raise APIError(400, str(err)) from None
            message = f"the server is busy: {err}; try again"
            raise APIError(503, message, kind="server_error", code="queue_full") from None
        return jobs

    def log_ignored(self, names: tuple[str, ...]) -> None:
        for name in names:
            if name not in self.ignored_seen:
                self.ignored_seen.add(name)
                self.log(f"note: the OpenAI field {name!r} changes nothing in this server's answers: accepted, ignored")


async def read_json(request: Request) -> Any:
    """The body as JSON, at most MAX_BODY_BYTES of it (413 beyond)."""
    too_large = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, digits beyond Python's limit, nested too deep
        raise APIError(400, "the request body is not valid JSON") from None


async def stream(call: Call, responder: Responder, bridge: Bridge, tool_marker: str) -> AsyncIterator[bytes]:
    """The answer as server-sent events, each chunk naming its choice: with ``echo``, each prompt first (with its
    tokens' log-probabilities where asked); a chunk for each piece of text (with the log-probabilities of the tokens
    behind it), one with each choice's finish reason, the usage if asked once every choice has ended, then
    ``[DONE]``. With tools, a choice's text is held from where its calls may begin (``tool_marker``, the text that
    opens them), and its calls come whole in one chunk once it has ended (:class:`ToolStream`)."""
    count = len(call.requests)
    for index, choice in enumerate(call.requests):
        if call.chat:
            yield event(responder.first_chunk(index))
        if call.echo is not None and choice.prompt_logprobs is None:
            yield event(responder.chunk(responder.echoed(index), [], index=index))
    pending: list[list[TokenLogprob]] = [[] for _ in range(count)]
    tools = call.tools
    held = [ToolStream(tool_marker, tools.forced) if tools is not None else None for _ in range(count)]
    ends: dict[int, Finished] = {}
    while len(ends) < count:
        index, item = await bridge.get()
        if isinstance(item, PromptLogprobs):
            if call.echo is not None:
                yield event(responder.chunk(responder.echoed(index), list(item.items), index=index))
        elif isinstance(item, Delta):
            pending[index] += [item.logprob] if item.logprob is not None else []
            text = item.text if held[index] is None else held[index].push(item.text)
            if text:
                yield event(responder.chunk(text, pending[index], index=index))
                pending[index] = []
        elif isinstance(item, Finished):
            for chunk in finish_chunks(responder, held[index], item, pending[index], index):
                yield event(chunk)
            ends[index] = item
        else:
            yield event(failure(item, call.constraint_param).body())
            break
    else:
        if call.include_usage:
            yield event(responder.usage_chunk([ends[index] for index in range(count)]))
    yield DONE


def finish_chunks(
    responder: Responder, held: ToolStream | None, finished: Finished, logprobs: list[TokenLogprob], index: int
) -> list[dict[str, Any]]:
    """The chunks that end a streamed choice: its calls, or the text held back for them; then its finish reason."""
    reason, chunks = finished.finish_reason, []
    if held is not None:
        _, calls = responder.tool_calls(finished)
        rest = held.end(calls)
        if rest:
            chunks.append(responder.chunk(rest, logprobs, index=index))
            logprobs = []
        if calls:
            chunks.append(responder.tool_calls_chunk(calls, index))
            reason = tool_finish(reason)
    return [*chunks, responder.chunk("", logprobs, reason, index)]


async def collect(
    bridge: Bridge, count: int, constraint_param: str | None = None
) -> list[tuple[Finished, list[TokenLogprob]]]:
    """The end of each of ``count`` requests, in order, with the log-probabilities of its tokens (the prompt's
    first, where they were asked for). A request that fails is an error: a 400 names the field its constraint came
    from (``constraint_param``: the grammar engine gave up on it while generating)."""
    ends: dict[int, Finished] = {}
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(count)]
    while len(ends) < count:
        index, item = await bridge.get()
        if isinstance(item, Failed):
            raise failure(item, constraint_param)
        if isinstance(item, Finished):
            ends[index] = item
        elif isinstance(item, PromptLogprobs):
            logprobs[index][:0] = item.items
        elif item.logprob is not None:
            logprobs[index].append(item.logprob)
    return [(ends[index], logprobs[index]) for index in range(count)]


def failure(failed: Failed, constraint_param: str | None) -> APIError:
    """A request's failure as an error: the server's (500), or its constraint's, which the grammar engine gave up on
    while generating (400, naming the field it came from)."""
    if failed.status != 400:
        return APIError(failed.status, failed.message, kind="server_error")
    return APIError(400, f"{constraint_param}: {failed.message}", param=constraint_param)


async def until_disconnected(request: Request, work: Any) -> Any:
    """Await ``work`` unless the client disconnects first (then None)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        continue


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def http_error(request: Request, exc: Exception) -> Response:
    """Routing's errors (no such path, method not allowed) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


async def internal_error(request: Request, exc: Exception) -> Response:
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", kind="server_error"))
