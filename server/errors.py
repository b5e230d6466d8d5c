"""OpenAI-style API errors: `{"error": {"message", "type", "param", "code"}}` with a fitting status."""
from __future__ import annotations

import logging

from sanic import response
from sanic.exceptions import SanicException

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A request the server refuses; `param` names the offending field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def invalid(message: str, param: str | None = None) -> APIError:
    """400: a value outside its allowed range, or a request the server cannot honour as asked."""
    return APIError(400, message, param)


def wrong_type(message: str, param: str | None = None) -> APIError:
    """422: a field of the wrong JSON type, or a required field that is missing."""
    return APIError(422, message, param)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(exc: Exception):
    """Render any exception as an OpenAI error body. Sanic's own (404 route, 405, 413 body too large,
    malformed request) keep their status and headers (a 405's Allow); anything else is a server
    fault (500)."""
    if isinstance(exc, APIError):
        return response.json(exc.body(), status=exc.status, headers=exc.headers)
    if isinstance(exc, SanicException):
        status = int(exc.status_code or 500)
        message = str(exc) or type(exc).__name__
        if status == 413 and "header" not in message.lower():      # Sanic's 413 for headers past its limit too
            message = f"request body too large: {message}"
        return response.json(error_body(status, message), status=status, headers=exc.headers)
    logging.getLogger("openinfer.server").error("request failed", exc_info=exc)
    return response.json(error_body(500, f"internal server error: {type(exc).__name__}: {exc}"),
                         status=500)
