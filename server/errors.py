"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, whatever raised them.

Clients (the `openai` package, LangChain) pick their exception by the status and show `message`, so every refusal
says in one line what was wrong: bad JSON or a field of the wrong type (400), an unknown model (404), a prompt
longer than the context (400, naming both lengths), a full queue (429 with Retry-After), a bad API key (401).
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, lambda _, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)


def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as OpenAI's 400: the first problem, its field as `param` (a.b.0.c)."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        message, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    else:
        param = ".".join(part for part in loc if _FIELD.fullmatch(part) and part not in _TYPE_NAMES) or None
        message = f"{param}: {first['msg']}" if param else "the body must be a JSON object"
    return ApiError(400, message, param=param).response()


# a field name or a list index; pydantic's loc also names the union member it tried (`str`, `Passage`, `list[str]`)
_FIELD = re.compile(r"[a-z_][a-z0-9_]*|\d+")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()
