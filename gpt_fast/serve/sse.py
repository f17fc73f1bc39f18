"""Server-sent events: a request's events carried from the batcher's thread to the event loop, and the streaming
response that cancels its request when it ends, however it ends (the client going away included)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gpt_fast.engine.batcher import Event

DONE = b"data: [DONE]\n\n"


def event(data: dict[str, Any]) -> bytes:
    """One server-sent event holding ``data`` as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Bridge:
    """The events of one call's requests, each with its choice's index: put from the batcher's thread, got on the
    event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def put(self, index: int, item: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, item))
        except RuntimeError:  # the event loop has closed (the server is stopping): nobody is listening
            return

    async def get(self) -> tuple[int, Event]:
        return await self.queue.get()


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that calls ``on_close`` when it ends: streamed to the end, or cut short
    because the client went away (the task streaming it is cancelled as soon as the client disconnects)."""

    def __init__(self, content: AsyncIterable[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
