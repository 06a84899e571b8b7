"""Retry limits (router/retry.py) on an injected clock, and the router's retry decisions (Router.proxy) over
scripted in-memory schedulers: what is retried, where, how often, and what reaches the client."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from protos import common_pb2, scheduler_pb2
from protos.registration import SchedulerInfo
from router.core import RequestError, Router, SampleState, StreamState
from router.detokenizer import IncrementalDetokenizer
from router.retry import BreakerState, CircuitBreaker, RetryBudget, RetryGovernor, RetryOptions
from router.upstream import UpstreamError


@dataclass
class FakeClock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


# --- budget and breaker ------------------------------------------------------------------------------------
def test_budget_allows_its_burst_then_refills_at_its_rate():
    clock = FakeClock()
    budget = RetryBudget(rate=2.0, burst=3.0, clock=clock)
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]
    clock.now += 0.4                      # 0.8 of a token: not yet
    assert not budget.try_spend()
    clock.now += 0.1
    assert budget.try_spend() and not budget.try_spend()
    clock.now += 100                      # never more than the burst
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]


def test_breaker_opens_after_consecutive_incidents_and_closes_after_cooldown_and_a_success():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown=10.0, clock=clock)
    assert not breaker.on_failure(clock.now)
    clock.now += 1
    assert breaker.on_failure(clock.now) and breaker.state() == BreakerState.OPEN and not breaker.allows()
    clock.now += 9.9
    assert breaker.state() == BreakerState.OPEN
    clock.now += 0.1
    assert breaker.state() == BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_success()
    assert breaker.state() == BreakerState.CLOSED and breaker.consecutive_failures == 0


def test_half_open_breaker_opens_again_at_its_first_failure():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, cooldown=5.0, clock=clock)
    assert breaker.on_failure(clock.now)
    clock.now += 5
    assert breaker.state() == BreakerState.HALF_OPEN
    assert breaker.on_failure(clock.now) and breaker.state() == BreakerState.OPEN
    clock.now += 4.9
    assert not breaker.allows()


def test_requests_failing_together_count_as_one_incident():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown=5.0, clock=clock)
    started = [clock.now - 3, clock.now - 2, clock.now - 1]   # all in flight when the worker crashed
    assert not any(breaker.on_failure(t) for t in started)
    assert breaker.consecutive_failures == 1 and breaker.state() == BreakerState.CLOSED
    clock.now += 1
    assert breaker.on_failure(clock.now)                       # a request sent after the crash fails too


def test_a_success_between_failures_keeps_the_breaker_closed():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown=5.0, clock=clock)
    breaker.on_failure(clock.now)
    clock.now += 1
    breaker.on_success()
    clock.now += 1
    assert not breaker.on_failure(clock.now) and breaker.state() == BreakerState.CLOSED


def info(scheduler_id: str) -> SchedulerInfo:
    return SchedulerInfo(scheduler_id, f"{scheduler_id}:1", "m", "", 16, 0, 0)


def test_plan_skips_open_breakers_but_fails_open_when_all_are_open():
    clock = FakeClock()
    governor = RetryGovernor(RetryOptions(breaker_failures=1), clock)
    a, b = info("a"), info("b")
    governor.on_failure("a", clock.now)
    plan = governor.plan([a, b])
    assert plan.targets == [b] and plan.skipped == ["a"]
    clock.now += 1
    governor.on_failure("b", clock.now)
    assert governor.plan([a, b]).targets == [a, b]
    assert governor.states() == {"a": BreakerState.OPEN, "b": BreakerState.OPEN}


def test_retry_denied_by_attempts_before_spending_the_budget():
    governor = RetryGovernor(RetryOptions(max_attempts=2, budget_rate=0.0, budget_burst=1.0), FakeClock())
    assert governor.retry_denied(2).label == "attempts"
    assert governor.retry_denied(1) is None             # spends the only token
    assert governor.retry_denied(1).label == "budget"


@pytest.mark.parametrize("fields", [{"max_attempts": 0}, {"breaker_failures": 0}, {"budget_rate": -1.0}])
def test_retry_options_refuse_nonsense(fields):
    with pytest.raises(ValueError):
        RetryOptions(**fields)


# --- the router's decisions over scripted schedulers --------------------------------------------------------
TOKENS = [5, 6, 7, 8]
UNAVAILABLE = UpstreamError(grpc.StatusCode.UNAVAILABLE, "worker step failed: UNAVAILABLE")


@dataclass
class ScriptedRequest:
    """Yields `tokens` one message each, then fails with `error` (or finishes)."""
    tokens: list[int]
    error: UpstreamError | None
    request: scheduler_pb2.ScheduleRequest
    closed: bool = False

    async def __aiter__(self):
        for i, token in enumerate(self.tokens):
            last = i == len(self.tokens) - 1 and self.error is None
            yield scheduler_pb2.ScheduleResponse(index=0, token_ids=[token], finish_reason=(
                common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED))
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True


@dataclass
class ScriptedConnection:
    tokens: list[int]
    error: UpstreamError | None = None
    submitted: list[ScriptedRequest] = field(default_factory=list)

    def submit(self, request, trace_context) -> ScriptedRequest:
        """A resumed request gets the tokens after those it resumes from."""
        self.submitted.append(ScriptedRequest(self.tokens[len(request.resumed_token_ids):], self.error, request))
        return self.submitted[-1]


class NoDirectory:
    """The schedulers the router knows now: none unless a test says so."""
    def __init__(self):
        self.forgotten: list[str] = []
        self.live: list[SchedulerInfo] = []

    def forget(self, scheduler_id: str) -> None:
        self.forgotten.append(scheduler_id)

    def schedulers(self) -> list[SchedulerInfo]:
        return self.live


def scripted_router(options: RetryOptions, *connections: ScriptedConnection,
                    clock: FakeClock | None = None) -> tuple[Router, list[SchedulerInfo]]:
    router = Router(NoDirectory(), retries=RetryGovernor(options, clock or FakeClock()))
    targets = [info(f"s{i}") for i in range(len(connections))]
    for target, connection in zip(targets, connections):
        router.connections[target.address] = connection
    return router, targets


def new_state(num_samples: int = 1) -> StreamState:
    return StreamState("r", 3, [SampleState(IncrementalDetokenizer(lambda ids: "".join(f"<{i}>" for i in ids)))
                                for _ in range(num_samples)])


async def run(router: Router, targets: list[SchedulerInfo], hold: bool,
              num_samples: int = 1) -> tuple[list[int], RequestError | None]:
    received: list[int] = []
    observed = router.telemetry.start(None)
    request = scheduler_pb2.ScheduleRequest(sampling=common_pb2.SamplingParams(n=num_samples, prompt_logprobs=1))
    try:
        async for response in router.proxy(targets, request, lambda: new_state(num_samples), observed, hold):
            received += response.token_ids
    except RequestError as e:
        return received, e
    return received, None


def sample(router: Router, name: str, **labels: str) -> float:
    return router.telemetry.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("hold", [False, True])
def test_failure_before_any_token_is_retried_on_the_next_scheduler(hold):
    dead, alive = ScriptedConnection([], UNAVAILABLE), ScriptedConnection(TOKENS)
    router, targets = scripted_router(RetryOptions(), dead, alive)
    assert asyncio.run(run(router, targets, hold)) == (TOKENS, None)
    assert sample(router, "ferry:router_retries_total", scheduler_id="s0") == 1
    assert sample(router, "ferry:router_failovers_total", scheduler_id="s1") == 1


def test_held_request_is_retried_after_tokens_and_answers_only_the_retry():
    failing, alive = ScriptedConnection(TOKENS[:2], UNAVAILABLE), ScriptedConnection(TOKENS)
    router, targets = scripted_router(RetryOptions(), failing, alive)
    assert asyncio.run(run(router, targets, hold=True)) == (TOKENS, None)


def test_streamed_request_that_sent_tokens_is_resumed_after_them_as_one_stream():
    failing, alive = ScriptedConnection(TOKENS[:2], UNAVAILABLE), ScriptedConnection(TOKENS)
    router, targets = scripted_router(RetryOptions(), failing, alive)
    assert asyncio.run(run(router, targets, hold=False)) == (TOKENS, None)   # nothing repeated, nothing lost
    resumed = alive.submitted[0].request
    assert resumed.resumed_token_ids == TOKENS[:2] and not resumed.sampling.HasField("prompt_logprobs")
    assert sample(router, "ferry:router_resumes_total", scheduler_id="s0") == 1
    assert sample(router, "ferry:router_retries_total", scheduler_id="s0") == 0


def test_a_stream_whose_plan_ran_out_resumes_on_a_scheduler_that_joined_after_it_was_planned():
    failing, joined = ScriptedConnection(TOKENS[:2], UNAVAILABLE), ScriptedConnection(TOKENS)
    router, targets = scripted_router(RetryOptions(), failing, joined)
    router.directory.live = targets                  # the second registered once the request was on its way
    assert asyncio.run(run(router, targets[:1], hold=False)) == (TOKENS, None)
    assert joined.submitted[0].request.resumed_token_ids == TOKENS[:2]


def test_a_resumed_stream_that_fails_again_is_resumed_after_all_the_tokens_sent():
    connections = [ScriptedConnection(TOKENS[:1], UNAVAILABLE), ScriptedConnection(TOKENS[:3], UNAVAILABLE),
                   ScriptedConnection(TOKENS)]
    router, targets = scripted_router(RetryOptions(), *connections)
    assert asyncio.run(run(router, targets, hold=False)) == (TOKENS, None)
    assert [list(c.submitted[0].request.resumed_token_ids) for c in connections] == [[], TOKENS[:1], TOKENS[:3]]


def test_streamed_request_of_several_samples_is_not_resumed():
    failing, alive = ScriptedConnection(TOKENS[:2], UNAVAILABLE), ScriptedConnection(TOKENS)
    router, targets = scripted_router(RetryOptions(), failing, alive)
    received, error = asyncio.run(run(router, targets, hold=False, num_samples=2))
    assert received == TOKENS[:2] and error.code == grpc.StatusCode.UNAVAILABLE and "worker step" in error.message
    assert not alive.submitted
    assert sample(router, "ferry:router_retries_denied_total", reason="streamed") == 1


def test_attempts_per_request_are_bounded_and_the_error_says_why():
    connections = [ScriptedConnection([], UNAVAILABLE) for _ in range(4)]
    router, targets = scripted_router(RetryOptions(max_attempts=2), *connections)
    received, error = asyncio.run(run(router, targets, hold=True))
    assert [len(c.submitted) for c in connections] == [1, 1, 0, 0]
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "worker step failed" in error.message and "2 attempts" in error.message


def test_spent_budget_stops_retries():
    connections = [ScriptedConnection([], UNAVAILABLE), ScriptedConnection(TOKENS)]
    router, targets = scripted_router(RetryOptions(budget_rate=0.0, budget_burst=0.0), *connections)
    received, error = asyncio.run(run(router, targets, hold=True))
    assert not connections[1].submitted and "retry budget" in error.message
    assert sample(router, "ferry:router_retries_denied_total", reason="budget") == 1


def test_a_lone_scheduler_fails_the_request_without_retrying_it():
    lone = ScriptedConnection([], UNAVAILABLE)
    router, targets = scripted_router(RetryOptions(), lone)
    received, error = asyncio.run(run(router, targets, hold=True))
    assert len(lone.submitted) == 1 and "no other scheduler" in error.message
    assert sample(router, "ferry:router_retries_denied_total", reason="no_scheduler") == 1


def test_other_errors_are_final():
    invalid = ScriptedConnection([], UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    alive = ScriptedConnection(TOKENS)
    router, targets = scripted_router(RetryOptions(), invalid, alive)
    received, error = asyncio.run(run(router, targets, hold=True))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and not alive.submitted


def test_full_schedulers_are_skipped_without_spending_retries():
    full = ScriptedConnection([], UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    alive = ScriptedConnection(TOKENS)
    router, targets = scripted_router(RetryOptions(budget_rate=0.0, budget_burst=0.0), full, alive)
    assert asyncio.run(run(router, targets, hold=False)) == (TOKENS, None)
    assert sample(router, "ferry:router_retries_total", scheduler_id="s0") == 0


def test_breaker_state_is_published_per_scheduler():
    clock = FakeClock()
    dead, alive = ScriptedConnection([], UNAVAILABLE), ScriptedConnection(TOKENS)
    router, targets = scripted_router(RetryOptions(breaker_failures=1, breaker_cooldown=5.0), dead, alive,
                                      clock=clock)
    asyncio.run(run(router, targets, hold=True))
    assert sample(router, "ferry:router_breaker_state", scheduler_id="s0") == BreakerState.OPEN
    assert sample(router, "ferry:router_breaker_trips_total", scheduler_id="s0") == 1
    assert sample(router, "ferry:router_breaker_state", scheduler_id="s1") == BreakerState.CLOSED
    clock.now += 5
    assert sample(router, "ferry:router_breaker_state", scheduler_id="s0") == BreakerState.HALF_OPEN
