"""The FastAPI application: the three route groups over one Engine, and every error in
OpenAI's shape (unknown routes and methods included)."""
from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .engine import Engine
from .errors import ApiError
from .openai_api import OpenAIRoutes
from .ops_api import OpsRoutes
from .scheduler import Busy, ClientGone
from .sglang_api import SGLangRoutes


OPEN_ROUTES = ("/health", "/health_generate")     # readiness probes answer without a key


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as v
    try:
        return v("dsv4-fidelity")
    except PackageNotFoundError:
        return "0+unknown"


def create_app(engine: Engine, api_key: str | None = None) -> FastAPI:
    """The app; with `api_key`, every route but the readiness probes wants it as a bearer
    token (OpenAI's 401 otherwise), as vLLM's and SGLang's --api-key do."""
    app = FastAPI(title="dsv4-fidelity", docs_url=None, redoc_url=None, openapi_url=None)
    ver = version()
    for routes in (OpenAIRoutes(engine), SGLangRoutes(engine), OpsRoutes(engine, ver)):
        app.include_router(routes.router())

    if api_key:
        want = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            got = request.headers.get("authorization", "").encode()
            if request.url.path not in OPEN_ROUTES and not hmac.compare_digest(got, want):
                return ApiError("Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                                None, 401, "invalid_api_key").response()
            return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError):
        return e.response()

    @app.exception_handler(Busy)
    async def busy(_: Request, e: Busy):
        return ApiError(f"the server has {engine.scheduler.max_jobs} requests in progress "
                        f"(--max-queue); retry after {e.retry_after} s", None, 429,
                        "rate_limit_exceeded", {"Retry-After": str(e.retry_after)}).response()

    @app.exception_handler(ClientGone)
    async def gone(_: Request, e: ClientGone):
        return Response(status_code=499)            # nobody reads it: the client left

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        if e.status_code == 404:
            msg, code = f"Not Found: {request.method} {request.url.path}", "not_found"
        elif e.status_code == 405:
            msg, code = f"Method Not Allowed: {request.method} {request.url.path}", "method_not_allowed"
        else:
            msg, code = str(e.detail), None
        return ApiError(msg, None, e.status_code, code).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        return ApiError(f"invalid request: {e.errors()}").response()

    @app.exception_handler(ValueError)
    async def value_error(_: Request, e: ValueError):       # the model's InputError included
        return ApiError(str(e)).response()

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception):
        return JSONResponse(ApiError(f"internal error: {type(e).__name__}: {e}", status=500).body(),
                            status_code=500)

    return app
