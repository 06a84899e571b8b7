"""The router's request path, independent of the wire: validate → tokenize → route → proxy → detokenize.

`Router.generate` is an async generator of GenerateResponse that the gRPC service (and an HTTP layer) reuse;
failures are RequestError with a gRPC status code and a reason.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context

from base.errors import StatusError
from base.prompt_checks import check_fits_context, check_token_ids
from base.sampling_params import SamplingParams
from protos import router_pb2, scheduler_pb2
from protos.block_hash import hash_blocks
from protos.registration import SchedulerInfo
from router.chat_messages import chat_chars, chat_template_inputs
from router.detokenizer import IncrementalDetokenizer
from router.disaggregation import prefill, rank_prefill, roles
from router.discovery import SchedulerDirectory
from router.generation_defaults import GenerationConfig, apply_defaults
from router.kv_pull import KvPull
from router.limits import KeyLease, KeyLimiter, OverLimit
from router.policy import (
    RoutingInput, RoutingPolicy, least_loaded, notify_finished, plan_route, policy_name, requested_adapter,
    with_adapter,
)
from router.prompt_length import check_prompt_chars, off_the_loop_if_long, truncated_prompt
from router.retry import RetryGovernor
from router.router_telemetry import RequestObservation, RouterTelemetry
from router.shared_limits import SharedKeyLimiter
from router.stream_state import SampleState, StreamState
from router.tenant_admission import TenantAdmission, TenantTicket
from router.tenants import Tenant, TenantDirectory
from router.tokenizer import ChatTemplating, RouterTokenizer, load_tokenizer
from router.upstream import SchedulerConnection, UpstreamError

JOIN_WAIT_S = 2.0     # how long a failed request looks for a scheduler it has not tried before it fails
JOIN_POLL_S = 0.1
MAX_CACHE_SALT_CHARS = 1024


class RequestError(StatusError):
    """Why the router refused or failed a request; `retry_after`: seconds, for RESOURCE_EXHAUSTED (0: the default);
    `param`: the request field at fault, where one is."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: int = 0, param: str | None = None):
        super().__init__(code, message)
        self.retry_after, self.param = retry_after, param


@dataclass
class AttemptLog:
    """One request's attempts so far: how many schedulers failed it and with what, how many were full, and
    whether any response has reached the client."""
    failures: int = 0
    error: UpstreamError | None = None
    failed_target: SchedulerInfo | None = None
    retry_pending: bool = False
    full: int = 0
    sent: bool = False

    def failed(self, target: SchedulerInfo, error: UpstreamError) -> None:
        self.failures, self.error, self.failed_target, self.retry_pending = self.failures + 1, error, target, True

    @property
    def reason(self) -> str:
        return self.error.message or self.error.code.name


@dataclass
class Router:
    directory: SchedulerDirectory
    policy: RoutingPolicy = least_loaded
    pending: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    prefilling: dict[str, int] = field(default_factory=lambda: defaultdict(int))   # prompt tokens, by scheduler id
    telemetry: RouterTelemetry = field(default_factory=RouterTelemetry)
    max_concurrent_requests: int = 4096
    stream_interval: int = 1   # tokens per message for a request that does not set its own
    in_flight: int = 0
    connections: dict[str, SchedulerConnection] = field(default_factory=dict)   # by scheduler address
    retries: RetryGovernor = field(default_factory=RetryGovernor)
    key_limiter: KeyLimiter | SharedKeyLimiter = field(default_factory=KeyLimiter)
    tenants: TenantDirectory = field(default_factory=TenantDirectory)
    tenant_admission: TenantAdmission = field(default_factory=TenantAdmission)
    chat_templating: ChatTemplating = field(default_factory=ChatTemplating)   # --chat-template and its kwargs
    generation_config: GenerationConfig = field(default_factory=GenerationConfig)   # sampling defaults

    def __post_init__(self) -> None:
        self.telemetry.metrics.watch_breakers(self.retries.states)

    async def generate(self, request: router_pb2.GenerateRequest, trace_parent: Context | None = None,
                       hold: bool = False, api_key: str = "", tenant_header: str = ""
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Yields the request's responses; `trace_parent` is the caller's trace context (gRPC or HTTP). With
        `hold` (a caller that answers only at the end) nothing is yielded before the request is done, so a failed
        scheduler's request can be retried at any point. `api_key`: the client's key, which its limits count;
        `tenant_header`: the tenant a trusted caller names (router/tenants.py)."""
        self.admit()
        tenant = self.tenant_of(api_key, tenant_header, request.priority)
        self.in_flight += 1
        observed = self.telemetry.start(trace_parent, tenant.name)
        lease, ticket, sent = self.key_limiter.lease(api_key), self.tenant_admission.ticket(tenant), False
        try:
            async with contextlib.aclosing(await self.route(request, observed, lease, ticket, hold)) as responses:
                async for response in responses:
                    ticket.started()
                    observed.on_response(response)
                    lease.charge(len(response.token_ids))
                    sent = True
                    yield response
        except RequestError as e:
            if not sent:   # failed before its first token: the key gets its prompt back
                lease.refund_prompt()
            observed.fail(e.code.name, e.message)
            raise
        finally:
            self.in_flight -= 1
            ticket.release()
            observed.finish()
            await lease.release()   # written before the client sees the end, so its next request sees it

    def admit(self) -> None:
        if self.in_flight >= self.max_concurrent_requests:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the router is at its limit of {self.max_concurrent_requests} concurrent requests; "
                               "retry later")

    def tenant_of(self, api_key: str, tenant_header: str, priority: int) -> Tenant:
        try:
            tenant = self.tenants.resolve(api_key, tenant_header)
        except StatusError as e:
            raise RequestError(e.code, e.message) from e
        try:
            tenant.policy.check_priority(tenant.name, priority)
        except StatusError as e:
            raise RequestError(e.code, e.message, param="priority") from e
        return tenant

    async def route(self, request: router_pb2.GenerateRequest, observed: RequestObservation, lease: KeyLease,
                    ticket: TenantTicket, hold: bool = False) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Validate and tokenize; admit it under its key's limits (`lease`), charging its prompt, and its tenant's
        (`ticket`); rank the schedulers; the request's responses from the one that takes it."""
        params = parse_sampling(request)   # the request as sent: its own mistakes are named before anything else
        check_cache_salt(request.cache_salt)
        candidates = self.candidates(request.model)
        if defaults := self.generation_config.defaults(candidates[0].model_path):
            apply_defaults(request.sampling, defaults)
            params = parse_sampling(request)
        num_chars = check_prompt_length(request, candidates[0].max_model_len)   # before any tokenizing
        tokenizer = await asyncio.to_thread(load_tokenizer, candidates[0].model_path, self.chat_templating)
        prompt_ids = await off_the_loop_if_long(num_chars, prompt_token_ids, request, tokenizer)
        prompt_ids = truncated_prompt(prompt_ids, params.truncate_prompt_tokens, params.max_tokens,
                                      candidates[0].max_model_len)
        check_prompt(prompt_ids, params, candidates[0])
        await admit_key(lease, len(prompt_ids))
        admit_tenant(ticket, len(prompt_ids))
        adapter = requested_adapter(request.model, candidates[0])
        hashes = hash_blocks(prompt_ids, candidates[0].block_size or 16, candidates[0].model, candidates[0].hash_seed,
                             adapter=adapter, salt=request.cache_salt)
        request_id = request.request_id or uuid.uuid4().hex
        routing = RoutingInput(prompt_ids, hashes, dict(self.pending),
                               await self.directory.prefix_matches(candidates[0].model, hashes),
                               prefix_index_live=self.directory.prefix_index_live, request_id=request_id,
                               adapter=adapter)
        disaggregated = roles(candidates)
        routed = plan_route(self.policy, disaggregated[1] if disaggregated else candidates, routing)
        if not routed.ranked:   # no candidate has the adapter loaded (any more)
            raise model_not_found(request.model, candidates)
        plan = self.retries.plan(routed.ranked)

        def new_state() -> StreamState:   # a fresh one per attempt: a retry starts from the first token
            return StreamState(request_id, len(prompt_ids),
                               [SampleState(IncrementalDetokenizer(decoder(tokenizer, params), params.stop,
                                                                   params.include_stop_str_in_output))
                                for _ in range(params.n)],
                               stream_interval=request.stream_interval or self.stream_interval,
                               scored_prompt=prompt_ids if params.prompt_logprobs is not None else None,
                               continuous_usage=request.continuous_usage)

        upstream = scheduler_pb2.ScheduleRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                                 sampling=request.sampling,   # validated (params), sent as it came
                                                 tenant=ticket.tenant.name, priority=request.priority,
                                                 tenant_weight=ticket.tenant.policy.weight, lora_name=adapter,
                                                 cache_salt=request.cache_salt)
        observed.routed(request_id, policy_name(self.policy), len(prompt_ids),
                        plan.targets, routing.matched_blocks, len(hashes), plan.skipped)
        if disaggregated:
            prefill_targets = rank_prefill(disaggregated[0], routing, self.prefilling)
            return self.prefilled(prefill_targets, plan.targets, upstream, new_state, observed, hold)
        return self.proxy(plan.targets, upstream, new_state, observed, hold, routed.pulls)

    async def prefilled(self, prefill_targets: list[SchedulerInfo], targets: list[SchedulerInfo],
                        upstream: scheduler_pb2.ScheduleRequest, new_state: Callable[[], StreamState],
                        observed: RequestObservation, hold: bool) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Disaggregated prefill and decode (router/disaggregation.py): the prompt on a prefill scheduler, then the
        request on a decode scheduler that pulls its KV from there."""
        num_prompt = len(upstream.prompt_token_ids)
        for target in prefill_targets[:1]:
            self.pending[target.scheduler_id] += 1
            self.prefilling[target.scheduler_id] += num_prompt
        try:
            source = await prefill(prefill_targets, upstream, targets[0].block_size or 16, self.connection,
                                   dict(observed.metadata))
        finally:
            for target in prefill_targets[:1]:
                self.pending[target.scheduler_id] -= 1
                self.prefilling[target.scheduler_id] -= num_prompt
        if source is not None:
            upstream.kv_source.CopyFrom(source)
        async for response in self.proxy(targets, upstream, new_state, observed, hold):
            yield response

    def connection(self, address: str) -> SchedulerConnection:
        if address not in self.connections:
            self.connections[address] = SchedulerConnection(self.directory.channel(address),
                                                            self.directory.call_metadata)
        return self.connections[address]

    def candidates(self, model: str) -> list[SchedulerInfo]:
        schedulers = self.directory.schedulers()
        if not schedulers:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no scheduler is available")
        if model:
            serving = [s for s in schedulers
                       if model == s.model or model in s.model_aliases or model in s.lora_adapters]
            if not serving:
                raise model_not_found(model, schedulers)
            return serving
        return schedulers

    async def proxy(self, targets: list[SchedulerInfo], upstream: scheduler_pb2.ScheduleRequest,
                    new_state: Callable[[], StreamState], observed: RequestObservation,
                    hold: bool = False, pulls: dict[str, KvPull] | None = None
                    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream from the first scheduler that takes the request. A full one is skipped for the next; one that
        fails it (UNAVAILABLE, or its stream breaks) is tried again on the next, within the retry limits: from the
        start while no response reached the client, else (one sample) resumed after the tokens the client has, so
        that it sees one stream; after that the failure is the client's. A target the policy planned a pull for
        (`pulls`, by scheduler id) is told where to pull the prompt's prefix from (kv_source)."""
        log, state = AttemptLog(), new_state()
        async for target in self.attempt_order(targets, log, upstream.lora_name):
            if log.retry_pending:
                self.allow_retry(log, observed, resuming=log.sent)
            started_at = self.retries.clock()
            request = with_kv_source(resumed_request(upstream, state) if log.sent else upstream,
                                     (pulls or {}).get(target.scheduler_id))
            try:
                async with contextlib.aclosing(self.attempt(target, request, state, observed, hold)) as attempt:
                    async for response in attempt:
                        log.sent = True
                        yield response
            except UpstreamError as e:
                self.on_attempt_failed(target, e, started_at, log, observed, state.resumable)
                state = state if log.sent else new_state()   # what a held attempt received is dropped
                continue
            self.retries.on_success(target.scheduler_id)
            if log.failures:
                observed.failed_over(target)
            return
        raise self.exhausted(log, observed)

    async def attempt(self, target: SchedulerInfo, upstream: scheduler_pb2.ScheduleRequest, state: StreamState,
                      observed: RequestObservation, hold: bool) -> AsyncIterator[router_pb2.GenerateResponse]:
        """One scheduler's try at the request; with `hold`, its responses come out only once it is done."""
        self.pending[target.scheduler_id] += 1
        observed.attempt(target)
        request = self.connection(target.address).submit(upstream, dict(observed.metadata))
        request.min_tokens = state.stream_interval
        held: list[router_pb2.GenerateResponse] = []
        try:
            async for message in request:
                response = state.on_response(message)
                if response is not None and hold:
                    held.append(response)
                elif response is not None:
                    yield response
                if state.done:
                    break
        finally:
            request.close()   # client gone, stop string matched, or done: the scheduler aborts what remains
            self.pending[target.scheduler_id] -= 1
            notify_finished(self.policy, upstream.request_id)
        for response in held:
            yield response

    async def attempt_order(self, planned: list[SchedulerInfo], log: AttemptLog, adapter: str = ""
                            ) -> AsyncIterator[SchedulerInfo]:
        """The planned schedulers in turn; then, while a failed request waits for another, any live one of its model
        (with its adapter loaded) that joined since it was planned (a long stream may outlive its plan; just after
        Redis lost everything the router knows only those that registered again, so it looks for JOIN_WAIT_S)."""
        tried = set()
        for target in planned:
            tried.add(target.scheduler_id)
            yield target
        deadline = asyncio.get_running_loop().time() + JOIN_WAIT_S
        while log.retry_pending and planned:
            joined = [s for s in with_adapter(self.directory.schedulers(), adapter)
                      if s.model == planned[0].model and s.scheduler_id not in tried]
            if joined:
                tried.add(joined[0].scheduler_id)
                yield joined[0]
            elif asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(JOIN_POLL_S)
            else:
                return

    def on_attempt_failed(self, target: SchedulerInfo, error: UpstreamError, started_at: float, log: AttemptLog,
                          observed: RequestObservation, resumable: bool) -> None:
        """Note a failed attempt for the next one, or raise the request's final error."""
        if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and (resumable or not log.sent):
            log.full += 1
            return
        if error.code != grpc.StatusCode.UNAVAILABLE:
            raise RequestError(error.code, error.message or error.code.name) from error
        if self.retries.on_failure(target.scheduler_id, started_at):
            observed.breaker_opened(target.scheduler_id)
        if error.connection_lost:
            self.directory.forget(target.scheduler_id)
        if log.sent and not resumable:   # tokens of several samples reached the client: a retry would answer twice
            observed.not_retried("streamed")
            raise RequestError(error.code, error.message or error.code.name) from error
        log.failed(target, error)

    def allow_retry(self, log: AttemptLog, observed: RequestObservation, resuming: bool) -> None:
        denied = self.retries.retry_denied(log.failures)
        if denied is not None:
            observed.not_retried(denied.label)
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{log.reason} (not retried: {denied.reason})")
        log.retry_pending = False
        if resuming:
            observed.resumed(log.failed_target, log.reason)
        else:
            observed.retried(log.failed_target, log.reason)

    @staticmethod
    def exhausted(log: AttemptLog, observed: RequestObservation) -> RequestError:
        if log.full:
            return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"every scheduler tried ({log.full}) is at capacity; retry later")
        if log.retry_pending:
            observed.not_retried("no_scheduler")
            return RequestError(grpc.StatusCode.UNAVAILABLE,
                                f"{log.reason} (not retried: no other scheduler to try)")
        return RequestError(grpc.StatusCode.UNAVAILABLE, "no scheduler could take the request")


def model_not_found(model: str, schedulers: list[SchedulerInfo]) -> RequestError:
    """NOT_FOUND naming `model` (a base model or LoRA adapter no live scheduler serves) and what is served."""
    names = sorted({s.model for s in schedulers} | {a for s in schedulers for a in s.lora_adapters + s.model_aliases})
    return RequestError(grpc.StatusCode.NOT_FOUND, f"model {model!r} does not exist (serving: {', '.join(names)})",
                       param="model")


def resumed_request(upstream: scheduler_pb2.ScheduleRequest, state: StreamState) -> scheduler_pb2.ScheduleRequest:
    """The request for a scheduler that goes on after the tokens the client has (its prompt logprobs, if asked
    for, went with the first of them)."""
    request = scheduler_pb2.ScheduleRequest()
    request.CopyFrom(upstream)
    request.resumed_token_ids.extend(state.samples[0].detokenizer.token_ids)
    request.sampling.ClearField("prompt_logprobs")
    return request


def with_kv_source(request: scheduler_pb2.ScheduleRequest, pull: KvPull | None) -> scheduler_pb2.ScheduleRequest:
    """The request as sent to a scheduler that pulls the prompt's prefix from its holder (`pull`), else as it is."""
    if pull is None:
        return request
    pulled = scheduler_pb2.ScheduleRequest()
    pulled.CopyFrom(request)
    pulled.kv_source.CopyFrom(pull.kv_source())
    return pulled


async def admit_key(lease: KeyLease, prompt_tokens: int) -> None:
    try:
        await lease.admit(prompt_tokens)
    except OverLimit as e:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message, e.retry_after) from e


def admit_tenant(ticket: TenantTicket, prompt_tokens: int) -> None:
    try:
        ticket.admit(prompt_tokens)
    except OverLimit as e:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message, e.retry_after) from e


def parse_sampling(request: router_pb2.GenerateRequest) -> SamplingParams:
    try:
        return SamplingParams.from_proto(request.sampling)
    except (ValueError, TypeError) as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e


def prompt_size(request: router_pb2.GenerateRequest) -> tuple[str, int]:
    """The prompt's field, as the APIs name it, and its length in characters (token ids: 0, counted as tokens)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return "prompt", len(request.text)
    if kind == "chat":
        return "messages", chat_chars(request.chat)
    return "prompt", 0


def check_prompt_length(request: router_pb2.GenerateRequest, max_model_len: int) -> int:
    """The prompt's length in characters; RequestError naming its field if that many cannot fit the context."""
    field, num_chars = prompt_size(request)
    try:
        check_prompt_chars(field, num_chars, max_model_len)
    except ValueError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e), param=field) from e
    return num_chars


def prompt_token_ids(request: router_pb2.GenerateRequest, tokenizer: RouterTokenizer) -> list[int]:
    kind = request.WhichOneof("prompt")
    try:
        if kind == "text":
            ids = tokenizer.encode(request.text)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
        elif kind == "chat":
            ids = tokenizer.encode_chat(*chat_template_inputs(request.chat))
        else:
            ids = []
    except ValueError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
    if not ids:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty")
    return ids


def decoder(tokenizer: RouterTokenizer, params: SamplingParams) -> Callable[[list[int]], str]:
    """The text of a sample's tokens: special tokens left out unless the request keeps them."""
    if params.skip_special_tokens:
        return tokenizer.decode
    return functools.partial(tokenizer.decode, skip_special_tokens=False)


def check_cache_salt(salt: str) -> None:
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} "
                           f"characters, got {len(salt)}", param="cache_salt")


def check_prompt(prompt_ids: list[int], params: SamplingParams, target: SchedulerInfo) -> None:
    """The prompt and logit_bias against the model's vocabulary and context, where the scheduler told them (0: not
    told)."""
    try:
        if target.vocab_size:
            check_token_ids(prompt_ids, target.vocab_size)
        if target.max_model_len:
            check_fits_context(len(prompt_ids), params.max_tokens, target.max_model_len)
    except ValueError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
    try:
        if target.vocab_size:
            check_token_ids(params.logit_bias, target.vocab_size, "logit_bias")
    except ValueError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e), param="logit_bias") from e
