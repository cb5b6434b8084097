"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, on every
route (engines' and OpenAI's clients read `error.message`; the official `openai` package
maps 400/404/429 to BadRequestError / NotFoundError / RateLimitError)."""
from __future__ import annotations

from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_exceeded", 503: "server_error",
         500: "server_error"}


class ApiError(Exception):
    """A request the server refuses, with the field it names and OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.param, self.status, self.code, self.headers = param, status, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def model_not_found(name) -> ApiError:
    return ApiError(f"The model `{name}` does not exist.", "model", 404, "model_not_found")
