"""RouterOptions: what `python -m router` serves with, each field the one source of its flag (base/options.py);
`ferry up` passes them on with to_argv."""
from __future__ import annotations

from dataclasses import dataclass

from base.config import DRAIN_TIMEOUT_S
from base.options import nested, no_flag, option
from base.tls import TlsConfig
from router.generation_defaults import GenerationConfig
from router.http.body import MAX_REQUEST_BYTES
from router.http.http_server import HttpLimits
from router.http.reasoning import REASONING_PARSERS
from router.http.tool_parsers import PARSERS
from router.kv_pull import KvPullOptions
from router.limits import KeyLimits
from router.policy import POLICIES
from router.retry import RetryOptions
from router.tokenizer import ChatTemplating


@dataclass
class RouterOptions:
    host: str = option("127.0.0.1", "address the router's gRPC port binds")
    port: int = option(50051, "the router's gRPC port")
    redis_url: str = option("", "the Redis where schedulers register", env="FERRY_REDIS_URL")
    schedulers: list[str] = option([], "a scheduler to use when Redis is unreachable", flag="--scheduler",
                                   repeat=True, metavar="HOST:PORT")
    model_path: str = option("", "tokenizer directory for --scheduler fallbacks")
    policy: str = option("cache_aware", "how a request's scheduler is picked", choices=sorted(POLICIES))
    kv_pull: KvPullOptions = nested(KvPullOptions())   # cache_aware's third choice: pull the prefix from its holder
    http_host: str = option("127.0.0.1", "OpenAI-compatible HTTP host")
    http_port: int = option(8000, "OpenAI-compatible HTTP port; 0: no HTTP")
    http_limits: HttpLimits = nested(HttpLimits())   # connections, header and body timeouts
    api_keys: list[str] = no_flag([])   # --api-key, --api-key-file, $FERRY_API_KEY (router/api_keys.py); none: no key
    key_tenants: dict[str, str] = no_flag({})   # --api-key-file's 'KEY TENANT' lines
    tenant_config: str = option("", "what each tenant may do, as a JSON object, inline or a file's path: {\"tenants\": "
                                    "{NAME: {\"weight\", \"priority\": [low, high], \"max_concurrent_requests\", "
                                    "\"max_queued_tokens\"}}, \"default\": {...}} (router/tenants.py)")
    shed_queued_requests: int = option(0, "when this many of the router's requests wait for their first token (the "
                                          "cluster is saturated), a new one is refused with 429 if its tenant holds "
                                          "its weighted share of them or more; 0: never shed")
    max_concurrent_requests: int = option(4096, "streams in flight; more get RESOURCE_EXHAUSTED / HTTP 429")
    stream_interval: int = option(1, "tokens per streamed message for requests that do not set their own "
                                     "(`stream_interval`): fewer messages, less CPU a token, tokens in bursts")
    enable_force_include_usage: bool = option(False, "every HTTP stream carries its usage on each chunk and in a "
                                                     "last chunk, as if it asked (vLLM's flag)",
                                              switch_on="--enable-force-include-usage")
    max_request_bytes: int = option(MAX_REQUEST_BYTES, "largest HTTP body (larger: 413) or gRPC message accepted")
    drain_timeout: float = option(DRAIN_TIMEOUT_S, "on SIGTERM, seconds in-flight streams get to finish")
    scheduler_keepalive: float = option(10.0, "a scheduler silent this many seconds is pinged; still silent after "
                                              "as long, its streams break and resume elsewhere")
    key_limits: KeyLimits = nested(KeyLimits())
    retry: RetryOptions = nested(RetryOptions())
    cluster_token: str = no_flag("")      # presented to schedulers
    redis_password: str = no_flag("")
    tls: TlsConfig = no_flag(TlsConfig())   # cert: TLS on gRPC and HTTP; ca: schedulers dialed over TLS, checked by it
    workers: int = option(1, "router processes sharing the gRPC and HTTP ports (SO_REUSEPORT); needs a fixed "
                             "--port")
    reuse_port: bool = no_flag(False)     # one of `--workers N`: the HTTP port is shared (gRPC's always may be)
    tool_call_parser: str = option("", 'the format "auto" tool calls are read in; empty: what the chat template '
                                       "shows", choices=sorted(PARSERS))
    chat_template: str = option("", "a Jinja chat template (a file's path, or the template's text) used instead "
                                    "of each model's own: for a model that has none (vLLM's flag)")
    default_chat_template_kwargs: str = option("", "JSON: the chat template's variables for a request that does not "
                                                    "set them in its chat_template_kwargs, e.g. "
                                                    "'{\"enable_thinking\": false}' (vLLM's flag)")
    generation_config: str = option("auto", "sampling defaults for what a request leaves unset: auto, those of the "
                                            "model's generation_config.json, as vLLM reads it (its max_new_tokens "
                                            "caps max_tokens); vllm, none; or a folder holding one (vLLM's flag)")
    override_generation_config: str = option("", "JSON: those defaults overridden or added, e.g. "
                                                  '\'{"temperature": 0.5}\'')
    reasoning_parser: str = option("", "chats' thinking (<think>...</think>) answered as the message's `reasoning`, "
                                       "apart from its content, read as this model family writes it; empty: all "
                                       "text is content", choices=sorted(REASONING_PARSERS))

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        self.chat_templating()   # a path that names no file, a template that does not compile, kwargs not JSON
        self.sampling_defaults().check()

    def chat_templating(self) -> ChatTemplating:
        return ChatTemplating.from_flags(self.chat_template, self.default_chat_template_kwargs)

    def sampling_defaults(self) -> GenerationConfig:
        return GenerationConfig(self.generation_config, self.override_generation_config)
