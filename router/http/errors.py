"""HTTP errors in OpenAI's shape: the status a client can act on, an error body, Retry-After on 429."""
from __future__ import annotations

import logging
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from base.errors import StatusError
from router.core import RequestError
from router.http.disconnect import ClientGone

log = logging.getLogger(__name__)

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
               grpc.StatusCode.ALREADY_EXISTS: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
               grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
               grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
               grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error",
               504: "timeout_error"}
UNREAD_BODY = (408, 413)   # the body was not read to its end: the connection cannot carry another request
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int = 0):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after or RETRY_AFTER_S

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.status == 429:
            headers["Retry-After"] = str(self.retry_after)
        if self.status in UNREAD_BODY:
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(error: Exception) -> APIError:
    """A failure of the router's generate, as the HTTP status a client can act on."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestError):
        return APIError(HTTP_STATUS.get(error.code, 500), error.message, param=error.param,
                        retry_after=error.retry_after)
    if isinstance(error, StatusError):
        return APIError(HTTP_STATUS.get(error.code, 500), error.message)
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    log.exception("generate failed", exc_info=error)
    return APIError(500, "internal error")


def validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    if not loc:
        return APIError(400, f"request body: {first['msg']}")
    return APIError(400, f"{'.'.join(loc)}: {first['msg']}", param=loc[0])


def reject_unsupported(problem: tuple[str, str] | None) -> None:
    if problem is not None:
        param, reason = problem
        raise APIError(400, reason, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    async def on_http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail)).response()

    async def on_client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)   # nobody reads it: the client hung up

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientGone, on_client_gone)
