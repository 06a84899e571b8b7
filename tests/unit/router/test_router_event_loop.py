"""The router's event loop stays free while prompts are tokenized (the real tiny tokenizer and chat template, no
processes): a prompt that cannot fit the context is refused by its length in characters, untokenized; a long one is
rendered and tokenized in a thread while the loop keeps running."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from protos import common_pb2, router_pb2
from protos.registration import SchedulerInfo
from router.core import RequestError, Router
from router.prompt_length import LONG_PROMPT_CHARS, MAX_CHARS_PER_TOKEN
from router.tokenizer import RouterTokenizer

MAX_MODEL_LEN = 1024


@dataclass
class OneScheduler:
    """A directory of one scheduler that nothing listens for: routing a request never dials it."""
    info: SchedulerInfo
    prefix_index_live: bool = False
    forgotten: list[str] = field(default_factory=list)

    def schedulers(self) -> list[SchedulerInfo]:
        return [self.info]

    async def prefix_matches(self, model: str, block_hashes: list[int]) -> dict[str, int]:
        return {}


def router_for(tiny_llama_dir, max_model_len: int = MAX_MODEL_LEN) -> Router:
    info = SchedulerInfo("s0", "127.0.0.1:1", "tiny", str(tiny_llama_dir), 16, max_model_len, 0)
    return Router(OneScheduler(info))


def request_of(kind: str, num_chars: int) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=1))
    text = ("the quick brown fox " * (num_chars // 20 + 1))[:num_chars]
    if kind == "prompt":
        request.text = text
    else:
        request.chat.messages.add(role="user", content=text)
    return request


async def route(router: Router, request: router_pb2.GenerateRequest) -> None:
    responses = await router.route(request, router.telemetry.start(None), router.key_limiter.lease(""),
                                   router.tenant_admission.ticket(router.tenants.tenant("default")))
    await responses.aclose()   # routed, not sent: nothing dials the scheduler


@pytest.mark.parametrize("kind", ["prompt", "messages"])
def test_a_prompt_too_long_for_the_context_is_refused_untokenized(tiny_llama_dir, monkeypatch, kind):
    tokenized = []
    monkeypatch.setattr(RouterTokenizer, "encode", lambda self, text: tokenized.append(text) or [1])
    with pytest.raises(RequestError) as refused:
        asyncio.run(route(router_for(tiny_llama_dir), request_of(kind, MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN + 1)))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused.value.param == kind
    assert refused.value.message.startswith(f"{kind} is ") and "characters" in refused.value.message
    assert tokenized == []


@pytest.mark.parametrize("kind", ["prompt", "messages"])
def test_a_long_prompt_is_tokenized_while_the_event_loop_keeps_running(tiny_llama_dir, monkeypatch, kind):
    """The tokenizer waits (up to 30 s) for the loop to turn while it works: on the loop it never would."""
    encode, loop_turned = RouterTokenizer.encode, []
    turns = [0]

    def encode_once_the_loop_turns(self, text: str) -> list[int]:
        seen, deadline = turns[0], time.monotonic() + 30
        while turns[0] == seen and time.monotonic() < deadline:
            time.sleep(0.001)
        loop_turned.append((turns[0] > seen, threading.current_thread() is threading.main_thread()))
        return encode(self, text)

    async def main() -> None:
        async def turn() -> None:
            while True:
                turns[0] += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(turn())
        try:
            await route(router_for(tiny_llama_dir, max_model_len=1 << 20), request_of(kind, 2 * LONG_PROMPT_CHARS))
        finally:
            ticker.cancel()

    monkeypatch.setattr(RouterTokenizer, "encode", encode_once_the_loop_turns)
    asyncio.run(main())
    assert loop_turned == [(True, False)]


def test_a_short_prompt_is_tokenized_on_the_loop(tiny_llama_dir, monkeypatch):
    """A thread's hop would cost more than a short prompt's tokenizing."""
    encode, threads = RouterTokenizer.encode, []

    def recorded(self, text: str) -> list[int]:
        threads.append(threading.current_thread() is threading.main_thread())
        return encode(self, text)

    monkeypatch.setattr(RouterTokenizer, "encode", recorded)
    asyncio.run(route(router_for(tiny_llama_dir), request_of("prompt", 100)))
    assert threads == [True]


def test_a_long_text_encodes_as_a_short_one_does(tiny_llama_dir):
    """Past LONG_PROMPT_CHARS the tokenizer encodes through the call that frees the GIL: the same ids."""
    tokenizer = RouterTokenizer(str(tiny_llama_dir))
    text = "Ünïcödé têxt, emoji 🚢 and 中文 " * (LONG_PROMPT_CHARS // 20)
    assert len(text) > LONG_PROMPT_CHARS
    assert tokenizer.encode(text) == tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
