"""A request body read within its size limit and parsed as JSON into the API's schema."""
from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from router.http.disconnect import ClientGone
from router.http.errors import APIError, validation_error

log = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)
MAX_REQUEST_BYTES = 4 << 20    # a request body (HTTP) or message (gRPC); larger ones are refused unread
BODY_TIMEOUT_S = 30.0          # an HTTP body that takes longer to arrive is refused (a slowloris client)
# What a body holding a lone surrogate must contain: a surrogate's \u escape, or its UTF-8 bytes (json.loads decodes
# them with surrogatepass), or the NULs of UTF-16/32 text. A body with none of them (most) is not walked.
SURROGATE_SIGN = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")


async def read_body(request: Request, max_bytes: int, timeout: float = BODY_TIMEOUT_S) -> bytes:
    """The body, refused (413) as soon as it is known to exceed max_bytes (from Content-Length, or while streaming),
    or (408) once it has taken more than timeout seconds to arrive; ClientGone if the client hangs up before sending
    all of it."""
    declared = request.headers.get("content-length", "")   # more digits than the limit has: too large, unparsed
    if declared.isdigit() and (len(declared) > len(str(max_bytes)) or int(declared) > max_bytes):
        raise body_too_large(max_bytes)
    try:
        async with asyncio.timeout(timeout):
            return await read_chunks(request, max_bytes)
    except TimeoutError:
        raise APIError(408, f"request body not received within {timeout:g} seconds") from None


async def read_chunks(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise body_too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        log.debug("client hung up after %d bytes of its request body", size)
        raise ClientGone() from None
    return b"".join(chunks)


def body_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body exceeds the limit of {max_bytes} bytes (the router's --max-request-bytes)")


def is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def escaped(text: str) -> str:
    return text.encode(errors="backslashreplace").decode()


def walked(value: Any) -> bool:
    return isinstance(value, (str, dict, list))


def first_non_unicode_string(data: Any) -> str | None:
    """The JSON path (messages[0].content; "": the body itself) of the first string, key or value, that UTF-8
    cannot encode: one holding a lone UTF-16 surrogate, which JSON's \\u escapes can spell but protobuf and
    tokenizers refuse."""
    pending: list[tuple[tuple[str, ...], Any]] = [((), data)]
    while pending:    # depth-first in document order, without recursion: JSON nests as deep as the parser allows
        path, value = pending.pop()
        if isinstance(value, str) and not is_utf8(value):
            return "".join(path).lstrip(".")
        if isinstance(value, dict):
            for key in value:
                if not is_utf8(key):
                    return "".join((*path, ".", escaped(key))).lstrip(".")
            pending.extend(((*path, f".{key}"), item) for key, item in reversed(value.items()) if walked(item))
        elif isinstance(value, list):
            pending.extend(((*path, f"[{i}]"), value[i]) for i in reversed(range(len(value))) if walked(value[i]))
    return None


def json_body(raw: bytes) -> Any:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:   # RecursionError: nested deeper than the parser goes
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    bad = first_non_unicode_string(data) if SURROGATE_SIGN.search(raw) else None
    if bad is not None:
        raise APIError(400, f"{bad or 'request body'}: not valid Unicode text (it holds a lone UTF-16 surrogate)",
                       param=bad or None)
    return data


async def parse_body(request: Request, schema: type[B], max_bytes: int = MAX_REQUEST_BYTES,
                     timeout: float = BODY_TIMEOUT_S) -> B:
    """The JSON body as schema, whatever Content-Type the client claimed (curl -d sends a form type)."""
    data = json_body(await read_body(request, max_bytes, timeout))
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e
