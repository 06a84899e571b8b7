"""A request body read within its size limit and parsed as JSON into the API's schema."""
from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from router.http.errors import APIError, validation_error

B = TypeVar("B", bound=BaseModel)
MAX_REQUEST_BYTES = 4 << 20    # a request body (HTTP) or message (gRPC); larger ones are refused unread


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused as soon as it is known to exceed max_bytes (from Content-Length, or while streaming)."""
    too_large = APIError(400, f"request body exceeds the limit of {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, schema: type[B], max_bytes: int = MAX_REQUEST_BYTES) -> B:
    """The JSON body as schema, whatever Content-Type the client claimed (curl -d sends a form type)."""
    raw = await read_body(request, max_bytes)
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e
