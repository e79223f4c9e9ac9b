"""The server's error type and OpenAI's error response: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from dsquant.runtime.server.protocol import error_body

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """Answer `status` with OpenAI's error body; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(message, ERROR_TYPES.get(status, "server_error"), status, param),
                        status_code=status, headers=headers)
