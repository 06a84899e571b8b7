"""OpenAI-compatible HTTP on the router: /v1/models, /v1/completions, /v1/chat/completions, /health.

The HTTP layer knows nothing of routing: it turns a request body into a GenerateRequest, runs the router's own
streaming `generate` (the code path the gRPC service uses) and shapes what comes back as OpenAI JSON or
server-sent events. A client that goes away cancels the generator, which cancels the upstream call.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import decoders

from base.tls import TlsConfig
from protos import common_pb2, router_pb2
from router.api_keys import bearer_token, matching_key
from router.core import RequestError
from router.discovery import SchedulerDirectory
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.tokenizer import RouterTokenizer, load_tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)

GenerateFn = Callable[..., AsyncIterator[router_pb2.GenerateResponse]]   # (request, *, hold=False, api_key="")
FINISH_REASONS = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
                  common_pb2.FINISH_REASON_ABORT: "abort"}
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
               grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
               grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
               grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error", 504: "timeout_error"}
RETRY_AFTER_S = 1
MAX_REQUEST_BYTES = 4 << 20    # a request body (HTTP) or message (gRPC); larger ones are refused unread


# --- models ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServedModel:
    name: str                  # what clients put in "model"
    route_name: str            # what the router matches schedulers on ("" when a scheduler did not say)
    tokenizer: RouterTokenizer
    max_model_len: int = 0

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes: exact for byte-level BPE, where a piece may be half a UTF-8 character."""
        tokenizer = self.tokenizer.tokenizer
        piece = tokenizer.id_to_token(token_id) or ""
        if isinstance(tokenizer.decoder, decoders.ByteLevel) and all(c in UNICODE_TO_BYTE for c in piece):
            return [UNICODE_TO_BYTE[c] for c in piece]
        return list(self.token_text(token_id).encode())


ModelsFn = Callable[[], list[ServedModel]]


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    mapping = {chr(b): b for b in printable}
    mapping.update({chr(256 + i): b for i, b in enumerate(extra)})
    return mapping


UNICODE_TO_BYTE = byte_level_alphabet()


def directory_models(directory: SchedulerDirectory) -> ModelsFn:
    """The models the live schedulers serve, one entry per name."""
    def served() -> list[ServedModel]:
        models: dict[str, ServedModel] = {}
        for info in directory.schedulers():
            name = info.model or Path(info.model_path).name
            if name not in models and info.model_path:
                models[name] = ServedModel(name, info.model, load_tokenizer(info.model_path), info.max_model_len)
        return list(models.values())
    return served


# --- errors ----------------------------------------------------------------------------------------------
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
        headers = {"Retry-After": str(self.retry_after)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(error: Exception) -> APIError:
    """A failure of the router's generate, as the HTTP status a client can act on."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestError):
        return APIError(HTTP_STATUS.get(error.code, 500), error.message, retry_after=error.retry_after)
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


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    async def on_http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail)).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)


class ApiKeyMiddleware:
    """Bearer-token check on /v1/*; /health stays open for load balancers. The key found goes into the request's
    state (`api_key`), for the per-key limits."""

    def __init__(self, app: Any, api_keys: list[str]):
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
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
        return matching_key(self.api_keys, bearer_token(given))


# --- response shapes ---------------------------------------------------------------------------------------
@dataclass
class Choice:
    index: int
    text: str = ""
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None

    def add(self, response: router_pb2.GenerateResponse) -> None:
        self.text += response.text
        self.logprobs.extend(response.logprobs)
        if response.finish_reason:
            self.finish_reason = FINISH_REASONS.get(response.finish_reason)
            self.stop_reason = response.stop_reason or None


@dataclass
class Collected:
    choices: list[Choice]
    usage: common_pb2.Usage | None = None


def usage_json(usage: common_pb2.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


@dataclass
class ResponseFormat:
    """Shapes one request's responses; subclasses know their API's JSON."""
    object_name: ClassVar[str]
    chunk_object: ClassVar[str]
    request_id: str
    model: ServedModel
    want_logprobs: bool
    include_usage: bool = False
    usage: common_pb2.Usage | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model.name,
                "choices": choices, **extra}

    def body(self, collected: Collected) -> dict[str, Any]:
        choices = [self.final_choice(c) for c in collected.choices]
        return self.envelope(self.object_name, choices, usage=usage_json(collected.usage))

    def chunk(self, response: router_pb2.GenerateResponse) -> dict[str, Any] | None:
        if response.HasField("usage"):
            self.usage = response.usage
        if not (response.text or response.logprobs or response.finish_reason):
            return None      # text held back (a possible stop string or half a character)
        choice = self.chunk_choice(response)
        return self.envelope(self.chunk_object, [choice], **({"usage": None} if self.include_usage else {}))

    def usage_chunk(self) -> dict[str, Any]:
        return self.envelope(self.chunk_object, [], usage=usage_json(self.usage))

    def opening_chunks(self, num_samples: int) -> list[dict[str, Any]]:
        return []

    def final_choice(self, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, response: router_pb2.GenerateResponse) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class CompletionFormat(ResponseFormat):
    object_name = chunk_object = "text_completion"
    text_offsets: dict[int, int] = field(default_factory=dict)

    def logprobs_json(self, entries: list[common_pb2.TokenLogprob], offset: int = 0) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        tokens = [self.model.token_text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.model.token_text(t.token_id): t.logprob for t in e.top} for e in entries],
                "text_offset": offsets}

    def final_choice(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "text": choice.text, "logprobs": self.logprobs_json(choice.logprobs),
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}

    def chunk_choice(self, response: router_pb2.GenerateResponse) -> dict[str, Any]:
        offset = self.text_offsets.get(response.index, 0)
        logprobs = self.logprobs_json(list(response.logprobs), offset)
        if logprobs is not None and logprobs["tokens"]:
            self.text_offsets[response.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return {"index": response.index, "text": response.text, "logprobs": logprobs,
                "finish_reason": FINISH_REASONS.get(response.finish_reason),
                "stop_reason": response.stop_reason or None}


@dataclass
class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def token_json(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.model.token_text(token_id), "logprob": logprob,
                "bytes": self.model.token_bytes(token_id)}

    def logprobs_json(self, entries: list[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {"content": [{**self.token_json(e.token_id, e.logprob),
                             "top_logprobs": [self.token_json(t.token_id, t.logprob) for t in e.top]}
                            for e in entries]}

    def final_choice(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": self.logprobs_json(choice.logprobs), "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}

    def chunk_choice(self, response: router_pb2.GenerateResponse) -> dict[str, Any]:
        return {"index": response.index, "delta": {"content": response.text} if response.text else {},
                "logprobs": self.logprobs_json(list(response.logprobs)),
                "finish_reason": FINISH_REASONS.get(response.finish_reason),
                "stop_reason": response.stop_reason or None}

    def opening_chunks(self, num_samples: int) -> list[dict[str, Any]]:
        extra = {"usage": None} if self.include_usage else {}
        return [self.envelope(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}], **extra)
                for i in range(num_samples)]


# --- streams ---------------------------------------------------------------------------------------------
async def started(responses: AsyncIterator[router_pb2.GenerateResponse]) -> AsyncIterator[router_pb2.GenerateResponse]:
    """Wait for the first response, so that a rejected request still gets its HTTP status."""
    try:
        first = await anext(responses)
    except StopAsyncIteration:
        first = None
    except Exception as e:
        raise api_error(e) from e
    return prepend(first, responses)


async def prepend(first: router_pb2.GenerateResponse | None,
                  rest: AsyncIterator[router_pb2.GenerateResponse]) -> AsyncIterator[router_pb2.GenerateResponse]:
    async with contextlib.aclosing(rest):
        if first is not None:
            yield first
        async for response in rest:
            yield response


async def collect(responses: AsyncIterator[router_pb2.GenerateResponse], num_samples: int) -> Collected:
    collected = Collected([Choice(i) for i in range(num_samples)])
    async with contextlib.aclosing(responses):
        try:
            async for response in responses:
                collected.choices[response.index].add(response)
                if response.HasField("usage"):
                    collected.usage = response.usage
        except Exception as e:
            raise api_error(e) from e
    return collected


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_events(responses: AsyncIterator[router_pb2.GenerateResponse], fmt: ResponseFormat,
                     num_samples: int) -> AsyncIterator[str]:
    async with contextlib.aclosing(responses):
        try:
            for chunk in fmt.opening_chunks(num_samples):
                yield sse(chunk)
            async for response in responses:
                chunk = fmt.chunk(response)
                if chunk is not None:
                    yield sse(chunk)
            if fmt.include_usage:
                yield sse(fmt.usage_chunk())
        except Exception as e:    # the status line has gone out: the error travels as an event
            yield sse(api_error(e).body())
    yield sse("[DONE]")


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run work; cancel it (and so the upstream stream) if the client hangs up first."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()


# --- the app -----------------------------------------------------------------------------------------------
@dataclass
class OpenAIServer:
    generate: GenerateFn
    models: ModelsFn
    max_request_bytes: int = MAX_REQUEST_BYTES

    def model(self, name: str) -> ServedModel:
        served = self.models()
        if not served:
            raise APIError(503, "no scheduler is available")
        if not name:
            return served[0]
        for model in served:
            if model.name == name:
                return model
        raise APIError(404, f"model {name!r} does not exist (serving: {', '.join(m.name for m in served)})",
                       param="model", code="model_not_found")

    async def health(self) -> Response:
        if not self.models():
            return JSONResponse({"status": "no scheduler is available"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "ferry",
                                            "max_model_len": m.max_model_len} for m in self.models()]}

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, self.max_request_bytes)
        reject_unsupported(body.unsupported())
        model = self.model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormat(request_id, model, body.logprobs is not None, body.include_usage)
        return await self.respond(request, body.generate_request(request_id, model.route_name), fmt, body.stream,
                                  body.num_samples)

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, self.max_request_bytes)
        reject_unsupported(body.unsupported())
        model = self.model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        max_tokens = body.requested_max_tokens
        if max_tokens is None and model.max_model_len:
            max_tokens = await self.room_left(model, body)
        fmt = ChatFormat(request_id, model, body.logprobs, body.include_usage)
        return await self.respond(request, body.generate_request(request_id, model.route_name, max_tokens), fmt,
                                  body.stream, body.num_samples)

    async def room_left(self, model: ServedModel, body: ChatCompletionRequest) -> int:
        """OpenAI's chat default: as many tokens as the context has left after the prompt."""
        try:
            prompt = await asyncio.to_thread(model.tokenizer.encode_chat, body.chat_messages())
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        return max(1, model.max_model_len - len(prompt))

    async def respond(self, request: Request, generate_request: router_pb2.GenerateRequest, fmt: ResponseFormat,
                      stream: bool, num_samples: int) -> Response:
        api_key = getattr(request.state, "api_key", "")
        if stream:
            responses = await started(self.generate(generate_request, api_key=api_key))
            return StreamingResponse(sse_events(responses, fmt, num_samples), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:   # held to the end by the router, so a failed scheduler's work can be retried at any point
            responses = self.generate(generate_request, hold=True, api_key=api_key)
            collected = await unless_disconnected(request, collect(responses, num_samples))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(fmt.body(collected))


def reject_unsupported(problem: tuple[str, str] | None) -> None:
    if problem is not None:
        param, reason = problem
        raise APIError(400, reason, param=param)


def create_app(generate: GenerateFn, *, models: ModelsFn, api_keys: list[str] | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The OpenAI-compatible app over a streaming generate function and the models behind it."""
    server = OpenAIServer(generate, models, max_request_bytes)
    app = FastAPI(title="Ferry", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.list_models, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    return app


# --- serving inside the router's event loop ------------------------------------------------------------------
def add_http_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http-host", default="127.0.0.1", help="OpenAI-compatible HTTP host")
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port; 0: no HTTP")


class EmbeddedServer(uvicorn.Server):
    """uvicorn as one task of a bigger asyncio program, which keeps its own signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class HttpServer:
    server: EmbeddedServer
    task: asyncio.Task

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve_http(app: FastAPI, host: str, port: int, drain_timeout: float = 2.0,
                     tls: TlsConfig = TlsConfig()) -> HttpServer:
    """Start serving app on host:port in the running event loop (HTTPS with tls.cert); OSError if the port cannot
    be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    server = EmbeddedServer(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=drain_timeout, **tls.uvicorn_options()))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
        raise OSError(f"HTTP server on {host}:{port} did not start")
    return HttpServer(server, task)
