"""OpenAI API request bodies, validated by pydantic, and their mapping onto Ferry's GenerateRequest.

Only bounds the wire needs are checked here (a negative max_tokens cannot become a uint32); the meaning of each
value (top-p in (0, 1], at least one sample, ...) is checked once, by base.sampling_params in the router's request
path.
The sampling fields are base.sampling_params.SamplingParams's: each is an HTTP field of its name and wire type,
except the few the APIs spell their own way (OWN_FIELDS).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from google.protobuf.descriptor import FieldDescriptor
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

from base.sampling_params import SAMPLING_FIELDS, WIRE_KINDS
from protos import common_pb2, router_pb2
from router.chat_messages import RESERVED_TEMPLATE_VARIABLES
from router.http.constraints import ResponseFormat, StructuredOutputs, add_constraints
from router.http.fill_in_middle import fim_prompt
from router.tokenizer import RouterTokenizer

UINT32_MAX = 2**32 - 1
INT32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
UINT32 = Annotated[int, Field(ge=0, le=UINT32_MAX)]
SEED = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TOP_LOGPROBS = Annotated[int, Field(ge=0, le=20)]
MAX_BATCH_PROMPTS = 256   # a completion's batch of prompts (each runs as a request of its own)
# OpenAI's optional switches take null for their default (off), as vLLM's do
SWITCH = Annotated[bool, BeforeValidator(lambda value: False if value is None else value)]
WIRE_TYPES = {FieldDescriptor.TYPE_UINT32: UINT32, FieldDescriptor.TYPE_INT32: INT32,
              FieldDescriptor.TYPE_FLOAT: float, FieldDescriptor.TYPE_DOUBLE: float, FieldDescriptor.TYPE_BOOL: bool,
              FieldDescriptor.TYPE_STRING: str}

# The sampling fields whose HTTP name, shape or value is the API's own, declared by hand below: a negative seed,
# stop as one string or a list, logit_bias keyed by strings, each API's logprobs, prompt_logprobs only for
# completions, structured output as response_format, structured_outputs or guided_*, an embedding only for
# /v1/embeddings (router/http/embeddings.py), and where a reasoning model's grammar starts only from the router's
# --reasoning-parser (router/http/app.py).
OWN_FIELDS = ("seed", "stop", "logit_bias", "logprobs", "prompt_logprobs", "structured_output", "return_embedding",
              "structured_output_after")
PLAIN_FIELDS = tuple(name for name in SAMPLING_FIELDS if name not in OWN_FIELDS)


def http_field(name: str) -> tuple[Any, None]:
    """A plain sampling field as the APIs take it: optional, of its wire type (the bounds the wire needs)."""
    value_type = WIRE_TYPES[common_pb2.SamplingParams.DESCRIPTOR.fields_by_name[name].type]
    return (list[value_type] if WIRE_KINDS[name] == "repeated" else value_type) | None, None


PlainSamplingFields = create_model("PlainSamplingFields", **{name: http_field(name) for name in PLAIN_FIELDS})


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: usage on every chunk too (with include_usage)


class RequestFields(BaseModel):
    """What every request that runs prompts takes beside them (completions, chat, embeddings, scores): the model,
    and vLLM's priority and cache salt."""
    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, BeforeValidator(lambda value: "" if value is None else value)] = ""   # null: the served one
    priority: INT32 | None = None           # vLLM's: lower is served first (--scheduling-policy priority or fair)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None   # vLLM's: prefix KV shared only within one salt


class SamplingRequest(PlainSamplingFields, RequestFields):
    """Fields both APIs share (OpenAI's, plus vLLM's extensions users already send): the plain sampling fields,
    the request's, and these."""
    model_config = ConfigDict(extra="ignore")

    stream: SWITCH = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: SWITCH = False   # vLLM's: logprobs name tokens "token_id:{id}"
    seed: SEED | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> added to its logit
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None   # vLLM's; guided_* are its older names
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    tools: list[dict[str, Any]] | None = None
    stream_interval: UINT32 | None = None   # tokens per streamed chunk; unset: the router's --stream-interval

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def num_samples(self) -> int:
        return self.n if self.n is not None else 1

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
        """The plain fields as given, and the API's own: max_tokens as the API resolves it, its logprobs."""
        given = {name: getattr(self, name) for name in PLAIN_FIELDS if getattr(self, name) is not None}
        given["max_tokens"] = max_tokens
        params = common_pb2.SamplingParams(**given, stop=stop_strings(self.stop))
        if self.seed is not None:
            params.seed = self.seed % 2**64      # a negative seed is as good a seed as any
        if logprobs is not None:
            params.logprobs = logprobs
        add_constraints(params, self)
        return params

    def envelope(self, request_id: str, model: str, sampling: common_pb2.SamplingParams) -> router_pb2.GenerateRequest:
        """The GenerateRequest of these sampling parameters, but for its prompt."""
        return router_pb2.GenerateRequest(request_id=request_id, model=model, sampling=sampling,
                                          stream_interval=self.stream_interval or 0, priority=self.priority or 0,
                                          continuous_usage=self.continuous_usage, cache_salt=self.cache_salt or "")


class CompletionRequest(SamplingRequest):
    prompt: str | list[UINT32] | list[str] | list[list[UINT32]]
    logprobs: TOP_LOGPROBS | None = None
    echo: SWITCH = False
    suffix: str | None = None
    best_of: UINT32 | None = None
    prompt_logprobs: TOP_LOGPROBS | None = None   # vLLM's extra field: each prompt token's logprob and top k

    def unsupported(self) -> tuple[str, str] | None:
        if len(self.prompts) > MAX_BATCH_PROMPTS:
            return "prompt", f"a batch may hold at most {MAX_BATCH_PROMPTS} prompts, got {len(self.prompts)}"
        if len(self.prompts) > 1 and self.suffix:
            return "suffix", "suffix takes one prompt, not a batch"
        if self.best_of is not None and self.best_of != self.num_samples:
            return "best_of", "best_of other than n is not supported"
        if self.tools:
            return "tools", "tools are for /v1/chat/completions"
        if self.stream and self.prompt_logprobs is not None:
            return "prompt_logprobs", "prompt_logprobs is not available when streaming: use echo with logprobs"
        return None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts: several where prompt is a list of strings or of token-id lists, else the one."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]

    @property
    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and len(self.prompt) == 1 and isinstance(self.prompt[0], (str, list)):
            return self.prompt[0]
        return self.prompt

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt scored and nothing generated (how lm-eval-harness scores text)."""
        return self.echo and self.max_tokens == 0

    @property
    def prompt_top_logprobs(self) -> int | None:
        """What the prompt's scoring asks for: the extra field, else echo's share of logprobs (as vLLM)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def echo_text(self, tokenizer: RouterTokenizer) -> str | None:
        if not self.echo:
            return None
        prompt = self.single_prompt
        return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)

    def generate_request(self, request_id: str, model: str, tokenizer: RouterTokenizer) -> router_pb2.GenerateRequest:
        """ValueError if a suffix is given and the model has no fill-in-the-middle tokens."""
        max_tokens = 1 if self.prompt_only else self.max_tokens   # its one token is dropped from the response
        request = self.envelope(request_id, model, self.sampling(max_tokens, self.logprobs))
        if self.prompt_top_logprobs is not None:
            request.sampling.prompt_logprobs = self.prompt_top_logprobs
        prompt = fim_prompt(self.single_prompt, self.suffix, tokenizer) if self.suffix else self.single_prompt
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return request


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    name: str
    arguments: str = "{}"    # JSON text, as the API returned it


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(part.text or "" for part in self.content)

    def to_proto(self) -> router_pb2.ChatMessage:
        calls = [router_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                 for c in self.tool_calls or []]
        return router_pb2.ChatMessage(role=self.role, content=self.text(), tool_calls=calls,
                                      tool_call_id=self.tool_call_id or "", name=self.name or "")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema; none: no arguments
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatTemplateFields(BaseModel):
    """vLLM's fields on how a chat's prompt is rendered (chat completions and /tokenize)."""
    chat_template_kwargs: dict[str, Any] | None = None   # further template variables: {"enable_thinking": false}
    add_generation_prompt: bool | None = None   # unset: true (the template opens the assistant's turn)
    continue_final_message: SWITCH = False      # the prompt ends inside the last message, for the model to go on

    def template_unsupported(self) -> tuple[str, str] | None:
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", "not with add_generation_prompt: the prompt ends in the last message"
        if reserved := sorted(RESERVED_TEMPLATE_VARIABLES & (self.chat_template_kwargs or {}).keys()):
            return "chat_template_kwargs", f"may not set {', '.join(reserved)}: the request's own fields do"
        return None

    def chat_proto(self, messages: list[ChatMessageIn], tools: list[ToolDefinition] | None
                   ) -> router_pb2.ChatMessages:
        chat = router_pb2.ChatMessages(
            messages=[m.to_proto() for m in messages], continue_final_message=self.continue_final_message,
            tools=json.dumps([t.model_dump(exclude_none=True) for t in tools]) if tools else "",
            template_kwargs=json.dumps(self.chat_template_kwargs) if self.chat_template_kwargs else "")
        if self.add_generation_prompt is not None:
            chat.add_generation_prompt = self.add_generation_prompt
        return chat


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: UINT32 | None = None
    logprobs: SWITCH = False
    top_logprobs: TOP_LOGPROBS | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = None   # vLLM's: false leaves the thinking out (with --reasoning-parser)

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        for i, message in enumerate(self.messages):
            try:
                message.text()
            except ValueError as e:
                return f"messages[{i}].content", str(e)
        return self.template_unsupported()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def chat(self) -> router_pb2.ChatMessages:
        return self.chat_proto(self.messages, self.tools)

    def generate_request(self, request_id: str, model: str, max_tokens: int | None,
                         prompt_ids: list[int] | None = None) -> router_pb2.GenerateRequest:
        """The chat for the router to render, or its prompt's ids where they are known already."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        request = self.envelope(request_id, model, self.sampling(max_tokens, logprobs))
        if prompt_ids is None:
            request.chat.CopyFrom(self.chat())
        else:
            request.token_ids.ids.extend(prompt_ids)
        return request


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""
    lora_name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\s/]+$")]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: Annotated[str, Field(min_length=1)]
