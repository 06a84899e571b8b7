"""The OpenAI-compatible app: its routes over the router's streaming generate and the models behind it."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from base.errors import StatusError
from protos import router_pb2
from router.chat_messages import chat_chars, chat_template_inputs
from router.http.auth import ApiKeyMiddleware
from router.http.body import BODY_TIMEOUT_S, MAX_REQUEST_BYTES, parse_body
from router.http.disconnect import unless_disconnected
from router.http.embeddings import Embedded, EmbeddingRequest, embedding_of, embeddings_body, matryoshka_of
from router.http.errors import APIError, api_error, install_error_handlers, reject_unsupported
from router.http.fill_in_middle import NoFillInTheMiddle
from router.http.formats import ChatFormat, CompletionFormat, ResponseFormat
from router.http.schema import (
    ChatCompletionRequest, CompletionRequest, LoadLoraAdapterRequest, SamplingRequest, StreamOptions,
    UnloadLoraAdapterRequest,
)
from router.http.scoring import RerankRequest, ScoreRequest, rerank_body, score_body
from router.http.served_models import ModelsFn, ServedModel
from router.http.prompt_batches import all_started, batch_sse_events, merged_body
from router.http.reasoning import REASONING_PARSERS, THINK_END
from router.http.responses import EventStream, ResponseObject, ResponsesRequest, response_events
from router.http.sse import sse_events
from router.http.streams import collect, started
from router.http.tokenization import DetokenizeRequest, TokenizeRequest
from router.http.tool_calls import add_grammar, detect_parser, tool_plan
from router.lora_admin import LoraAdmin
from router.prompt_length import check_prompt_chars, off_the_loop_if_long, truncated_prompt
from router.tenants import TENANT_HEADER

# (request, *, hold=False, api_key="", tenant_header="")
GenerateFn = Callable[..., AsyncIterator[router_pb2.GenerateResponse]]
Generation = TypeVar("Generation", bound=SamplingRequest)


@dataclass
class OpenAIServer:
    generate: GenerateFn
    models: ModelsFn
    max_request_bytes: int = MAX_REQUEST_BYTES
    tool_call_parser: str = ""     # "auto" tool choice's format; "": told by each model's chat template
    body_timeout: float = BODY_TIMEOUT_S
    lora_admin: LoraAdmin | None = None   # run-time LoRA loads (None: the routes answer 404)
    force_include_usage: bool = False     # streams carry usage on every chunk and at the end, asked or not
    reasoning_parser: str = ""            # chats' thinking read into `reasoning` (router/http/reasoning.py)

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
                                            "root": m.name, "parent": m.parent or None,
                                            "max_model_len": m.max_model_len} for m in self.models()]}

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: every live scheduler loads the PEFT adapter at lora_path; requests then name it as their model."""
        body = await parse_body(request, LoadLoraAdapterRequest, self.max_request_bytes, self.body_timeout)
        if any(m.name == body.lora_name for m in self.models() if not m.parent):
            raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name")
        try:
            count = await self.admin().load(body.lora_name, body.lora_path)
        except StatusError as e:
            raise api_error(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully ({count} "
                                 f"scheduler{'s' if count != 1 else ''}).")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: no new request may name it; those running with it finish."""
        body = await parse_body(request, UnloadLoraAdapterRequest, self.max_request_bytes, self.body_timeout)
        try:
            await self.admin().unload(body.lora_name)
        except StatusError as e:
            raise api_error(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's: the prompt's ids as the model runs them, their count and the model's context length."""
        body = await parse_body(request, TokenizeRequest, self.max_request_bytes, self.body_timeout)
        reject_unsupported(body.unsupported())
        model = self.model(body.model)
        if body.messages is not None:
            ids = await chat_prompt_ids(model, body)
        else:
            check_length("prompt", len(body.prompt), model.max_model_len)
            ids = await off_the_loop_if_long(len(body.prompt), model.tokenizer.encode, body.prompt,
                                             body.add_special_tokens)
        strs = [model.tokenizer.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict[str, str]:
        """vLLM's: the text of the ids, special tokens included."""
        body = await parse_body(request, DetokenizeRequest, self.max_request_bytes, self.body_timeout)
        model = self.model(body.model)
        vocab_size = model.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        if any(token >= vocab_size for token in body.tokens):
            raise APIError(400, f"tokens: ids must be below the vocabulary's {vocab_size}", param="tokens")
        return {"prompt": model.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    async def embeddings(self, request: Request) -> JSONResponse:
        """OpenAI's: each input's embedding (router/http/embeddings.py), in the input's order."""
        body = await parse_body(request, EmbeddingRequest, self.max_request_bytes, self.body_timeout)
        reject_unsupported(body.unsupported())
        model = self.model(body.model)
        if body.dimensions is not None:
            matryoshka_of(model.model_path).check(body.dimensions, model.name)
        results = await self.embed(request, model, body)
        return JSONResponse(embeddings_body(results, model.alias_of or model.name, body))

    async def score(self, request: Request) -> JSONResponse:
        """vLLM's: the cosine similarity of text_1's embedding and each of text_2's (router/http/scoring.py)."""
        body = await parse_body(request, ScoreRequest, self.max_request_bytes, self.body_timeout)
        reject_unsupported(body.unsupported())
        model = self.model(body.model)
        embedded = await self.embed(request, model, body.embedding_request(body.firsts + body.seconds))
        return JSONResponse(score_body(body, embedded, model.alias_of or model.name))

    async def rerank(self, request: Request) -> JSONResponse:
        """vLLM's: the documents by the cosine similarity of their embeddings to the query's, best first."""
        body = await parse_body(request, RerankRequest, self.max_request_bytes, self.body_timeout)
        model = self.model(body.model)
        embedded = await self.embed(request, model, body.embedding_request([body.query, *body.documents]))
        return JSONResponse(rerank_body(body, embedded, model.alias_of or model.name))

    async def embed(self, request: Request, model: ServedModel, body: EmbeddingRequest) -> Embedded:
        """Each input's embedding and token count, one request each, run side by side."""
        caller = self.caller(request)
        prompts = [await embedding_prompt(prompt, body.add_special_tokens, model) for prompt in body.inputs]
        requests = body.generate_requests(f"embd-{uuid.uuid4().hex}", model.route_name, prompts)
        work = asyncio.gather(*[embedding_of(self.generate(r, hold=True, **caller)) for r in requests])
        return await unless_disconnected(request, work)

    def admin(self) -> LoraAdmin:
        if self.lora_admin is None:
            raise APIError(404, "run-time LoRA loading is not available here")
        return self.lora_admin

    async def completions(self, request: Request) -> Response:
        body = await self.generation_body(request, CompletionRequest)
        reject_unsupported(body.unsupported())
        model = self.model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if len(body.prompts) > 1:
            parts = [await completion_part(body.model_copy(update={"prompt": prompt}), request_id, f"{request_id}-{i}",
                                           model) for i, prompt in enumerate(body.prompts)]
            return await self.respond_batch(request, parts, body.stream, body.num_samples)
        generate_request, fmt = await completion_part(body, request_id, request_id, model)
        return await self.respond(request, generate_request, fmt, body.stream, body.num_samples)

    async def generation_body(self, request: Request, schema: type[Generation]) -> Generation:
        body = await parse_body(request, schema, self.max_request_bytes, self.body_timeout)
        if self.force_include_usage and body.stream:
            body.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
        return body

    async def chat_completions(self, request: Request) -> Response:
        body = await self.generation_body(request, ChatCompletionRequest)
        reject_unsupported(body.unsupported())
        model = self.model(body.model)
        generate_request, fmt = await self.chat_plan(body, model, f"chatcmpl-{uuid.uuid4().hex}")
        return await self.respond(request, generate_request, fmt, body.stream, body.num_samples)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, run as a chat (router/http/responses.py)."""
        body = await parse_body(request, ResponsesRequest, self.max_request_bytes, self.body_timeout)
        reject_unsupported(body.unsupported())
        chat = body.chat_request()
        reject_unsupported(chat.unsupported())
        model = self.model(chat.model)
        answer = ResponseObject(body, model.alias_of or model.name)
        generate_request, fmt = await self.chat_plan(chat, model, answer.id)
        if body.stream:
            responses = await started(self.generate(generate_request, **self.caller(request)))
            return StreamingResponse(response_events(responses, fmt, EventStream(answer)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        responses = self.generate(generate_request, hold=True, **self.caller(request))
        collected = await unless_disconnected(request, collect(responses, 1))
        return JSONResponse(answer.whole(fmt.body(collected)))

    async def chat_plan(self, body: ChatCompletionRequest, model: ServedModel, request_id: str
                        ) -> tuple[router_pb2.GenerateRequest, ChatFormat]:
        """A chat's request for the router, and the format that reads its answer (reasoning, tool calls)."""
        max_tokens, prompt_ids = body.requested_max_tokens, None
        if max_tokens is None and model.max_model_len:   # OpenAI's default: what the context has left after the prompt
            prompt_ids = truncated_prompt(await chat_prompt_ids(model, body), body.truncate_prompt_tokens, 0,
                                          0)   # -1 is the router's to apply, once max_tokens is known
            max_tokens = max(1, model.max_model_len - len(prompt_ids))
        tools = tool_plan(body, detect_parser(self.tool_call_parser, model.tokenizer.chat_template))
        generate_request = body.generate_request(request_id, model.route_name, max_tokens, prompt_ids)
        add_grammar(tools, generate_request.sampling)
        if tools.keeps_special_tokens:
            generate_request.sampling.skip_special_tokens = False
        reasoning = REASONING_PARSERS.get(self.reasoning_parser)
        if reasoning and generate_request.sampling.HasField("structured_output"):   # it holds after the thinking
            generate_request.sampling.structured_output_after.extend(model.tokenizer.encode(THINK_END))
        fmt = ChatFormat(request_id, model, body.logprobs, body.include_usage, body.continuous_usage,
                         tokens_as_ids=body.return_tokens_as_token_ids, tools=tools, reasoning=reasoning,
                         include_reasoning=body.include_reasoning is not False)
        return generate_request, fmt

    @staticmethod
    def caller(request: Request) -> dict[str, str]:
        """Who sends the request, as the router's generate takes it."""
        return dict(api_key=getattr(request.state, "api_key", ""), tenant_header=request.headers.get(TENANT_HEADER, ""))

    async def respond(self, request: Request, generate_request: router_pb2.GenerateRequest, fmt: ResponseFormat,
                      stream: bool, num_samples: int) -> Response:
        if stream:
            responses = await started(self.generate(generate_request, **self.caller(request)))
            return StreamingResponse(sse_events(responses, fmt, num_samples), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        # held to the end by the router, so a failed scheduler's work can be retried at any point
        responses = self.generate(generate_request, hold=True, **self.caller(request))
        collected = await unless_disconnected(request, collect(responses, num_samples))   # or ClientGone: 499
        return JSONResponse(fmt.body(collected))

    async def respond_batch(self, request: Request, parts: list[tuple[router_pb2.GenerateRequest, CompletionFormat]],
                            stream: bool, num_samples: int) -> Response:
        """A batch of prompts side by side, answered as one (router/http/prompt_batches.py)."""
        caller = self.caller(request)
        formats = [fmt for _, fmt in parts]
        if stream:
            streams = await all_started([self.generate(g, **caller) for g, _ in parts])
            return StreamingResponse(batch_sse_events(streams, formats, num_samples), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        work = asyncio.gather(*[collect(self.generate(g, hold=True, **caller), num_samples) for g, _ in parts])
        collected = await unless_disconnected(request, work)
        return JSONResponse(merged_body([fmt.body(c) for fmt, c in zip(formats, collected)], num_samples))


async def completion_part(body: CompletionRequest, response_id: str, request_id: str, model: ServedModel
                          ) -> tuple[router_pb2.GenerateRequest, CompletionFormat]:
    """One prompt's request, and the format of its answer (under response_id, a batch's shared id)."""
    generate_request = await completion_request(body, request_id, model)
    fmt = CompletionFormat(response_id, model, body.logprobs is not None, body.include_usage, body.continuous_usage,
                           tokens_as_ids=body.return_tokens_as_token_ids, echo=body.echo_text(model.tokenizer),
                           prompt_only=body.prompt_only,
                           want_prompt_logprobs=body.prompt_logprobs is not None)
    return generate_request, fmt


async def embedding_prompt(prompt: str | list[int], add_special_tokens: bool, model: ServedModel) -> list[int]:
    """An input's ids: as given, or its text tokenized with the tokenizer's special tokens where asked (vLLM's
    default for embeddings, unlike completions)."""
    if not isinstance(prompt, str):
        return prompt
    check_length("input", len(prompt), model.max_model_len)
    return await off_the_loop_if_long(len(prompt), model.tokenizer.encode, prompt, add_special_tokens)


async def chat_prompt_ids(model: ServedModel, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """The chat's prompt, rendered and tokenized (once: the router takes these ids rather than the messages)."""
    chat = body.chat()
    check_length("messages", chat_chars(chat), model.max_model_len)
    try:
        return await asyncio.to_thread(model.tokenizer.encode_chat, *chat_template_inputs(chat))
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e


async def completion_request(body: CompletionRequest, request_id: str,
                             model: ServedModel) -> router_pb2.GenerateRequest:
    """The GenerateRequest of a completion. With a suffix its prompt is tokenized here (in fill-in-the-middle
    order), after the length check the router makes before it tokenizes."""
    if not body.suffix:
        return body.generate_request(request_id, model.route_name, model.tokenizer)
    prompt = body.single_prompt
    num_chars = (len(prompt) if isinstance(prompt, str) else 0) + len(body.suffix)
    check_length("prompt", num_chars, model.max_model_len)
    try:
        return await off_the_loop_if_long(num_chars, body.generate_request, request_id, model.route_name,
                                          model.tokenizer)
    except NoFillInTheMiddle as e:
        raise APIError(400, str(e), param="suffix") from e


def check_length(field: str, num_chars: int, max_model_len: int) -> None:
    try:
        check_prompt_chars(field, num_chars, max_model_len)
    except ValueError as e:
        raise APIError(400, str(e), param=field) from e


def create_app(generate: GenerateFn, *, models: ModelsFn, api_keys: list[str] | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES, tool_call_parser: str = "",
               body_timeout: float = BODY_TIMEOUT_S, lora_admin: LoraAdmin | None = None,
               force_include_usage: bool = False, reasoning_parser: str = "") -> FastAPI:
    """The OpenAI-compatible app over a streaming generate function and the models behind it."""
    server = OpenAIServer(generate, models, max_request_bytes, tool_call_parser, body_timeout, lora_admin,
                          force_include_usage, reasoning_parser)
    app = FastAPI(title="Ferry", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.list_models, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", server.responses, methods=["POST"])
    app.add_api_route("/v1/load_lora_adapter", server.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", server.unload_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/embeddings", server.embeddings, methods=["POST"])
    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/score", server.score, methods=["POST"])
    for prefix in ("", "/v1", "/v2"):
        app.add_api_route(f"{prefix}/rerank", server.rerank, methods=["POST"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    return app
