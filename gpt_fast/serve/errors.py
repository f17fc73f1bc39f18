"""The server's refusals in OpenAI's shape: an HTTP status and ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
