"""The API-key check in front of every route but the open ones (health and metrics)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.api_keys import presented_key
from router.http.errors import APIError


OPEN_PATHS = ("/health", "/metrics")   # for load balancers and Prometheus


class ApiKeyMiddleware:
    """Bearer-token check on every route (/v1/*, and vLLM's outside it: /tokenize, /score, /rerank, ...) but
    OPEN_PATHS. The key found goes into the request's state (`api_key`), for the per-key limits."""

    def __init__(self, app: Any, api_keys: list[str]):
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            key = self.key_of(scope)
            if key is None:
                error = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)

    def key_of(self, scope: dict) -> str | None:
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        return presented_key(self.api_keys, given)
