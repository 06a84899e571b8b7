"""Hostile bodies on a real router, whose stderr the tests read: a string that is not Unicode text (a lone UTF-16
surrogate, which JSON can spell), a logit_bias that is not token ids and biases, a prompt longer than the context can
hold are 400 naming their field; a body over the size limit is 413; a client that hangs up half-way through its body
leaves no traceback; one that trickles its headers or body in is cut off. The router keeps serving after each."""
from __future__ import annotations

import contextlib
import json
import select
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from ferry.launcher import free_port, wait_for_health
from protos import common_pb2, router_pb2
from router.http.body import MAX_REQUEST_BYTES
from tests.services_fixtures import CHILD_ENV, start_services, wait_until

LONE = "\ud800"     # json.dumps writes it as the escape \ud800, which json.loads reads back as it is
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
TIMEOUT_S = 2          # the router's header and body timeouts here


@dataclass
class Router:
    http: str
    stderr: Path
    grpc_address: str

    def post(self, path: str, body: dict | bytes) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.http + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")


@pytest.fixture(scope="module")
def router(tiny_llama_dir, tmp_path_factory) -> Iterator[Router]:
    services = start_services(tiny_llama_dir, num_schedulers=1)
    stderr = tmp_path_factory.mktemp("router") / "stderr.log"
    try:
        port, http_port = free_port(), free_port()
        with open(stderr, "wb") as log:
            services.stack.start([sys.executable, "-m", "router", "--port", str(port), "--redis-url",
                                  services.redis_url, "--http-port", str(http_port), "--http-header-timeout",
                                  str(TIMEOUT_S), "--http-body-timeout", str(TIMEOUT_S)], "router with HTTP",
                                 env=CHILD_ENV, stderr=log)
        wait_for_health(f"127.0.0.1:{port}", services.stack, timeout=60)
        http = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: httpx.get(http + "/health").status_code == 200, "HTTP health")
        yield Router(http, stderr, f"127.0.0.1:{port}")
    finally:
        services.stop()


def assert_serves(router: Router) -> None:
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        response = router.post(path, body)
        assert response.status_code == 200, response.text


# --- strings that are not Unicode text ---------------------------------------------------------------------
TOOL_CALL = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": '{"x": "' + LONE + '"}'}}]}


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {**COMPLETION, "prompt": f"hi {LONE}"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [f"hi {LONE}"]}, "prompt[0]"),
    ("/v1/completions", {**COMPLETION, "stop": ["ok", LONE]}, "stop[1]"),
    ("/v1/completions", {**COMPLETION, "suffix": LONE}, "suffix"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": f"{LONE} hi"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "messages": [CHAT["messages"][0], TOOL_CALL]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_a_lone_surrogate_is_400_naming_the_field_and_the_router_keeps_serving(router, path, body, field):
    response = router.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field
    assert error["message"].startswith(f"{field}: ") and "surrogate" in error["message"]
    assert_serves(router)


def test_a_surrogate_in_raw_utf8_bytes_is_400_too(router):
    """json.loads decodes a body with surrogatepass: the three UTF-8 bytes of U+D800 become a lone surrogate."""
    response = router.post("/v1/completions", b'{"prompt": "hi \xed\xa0\x80", "max_tokens": 2}')
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


def test_escaped_surrogate_pairs_are_text_and_served(router):
    """The escapes a JSON encoder writes for a character beyond the BMP (ensure_ascii) are one character."""
    response = router.post("/v1/completions", json.dumps({**COMPLETION, "prompt": "hi \U0001F600"}).encode())
    assert response.status_code == 200, response.text


def test_a_grpc_client_cannot_send_a_lone_surrogate():
    """protobuf refuses to encode the string on the client's side, so the router never sees one over gRPC."""
    with pytest.raises(UnicodeEncodeError):
        router_pb2.GenerateRequest(text=f"hi {LONE}")


def test_a_grpc_request_that_does_not_parse_is_invalid_argument_and_the_router_keeps_serving(router):
    """A client in another language can put bytes that are not UTF-8 in a string field; protobuf cannot parse it."""
    text_field = bytes([2 << 3 | 2, 4]) + b"hi \xff"                         # field 2 (text), 4 bytes, not UTF-8
    with grpc.insecure_channel(router.grpc_address) as channel:
        generate = channel.unary_stream("/ferry.Router/Generate", request_serializer=lambda raw: raw,
                                        response_deserializer=router_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            list(generate(text_field, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not parse" in refused.value.details()
        valid = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=2))
        assert list(generate(valid.SerializeToString(), timeout=30))
    assert "Traceback" not in router.log()


# --- clients that hang up half-way through their body -------------------------------------------------------
def send_half_a_body_and_hang_up(http: str) -> None:
    host, port = http.removeprefix("http://").split(":")
    body = json.dumps(COMPLETION).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) * 10}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(head + body)
        time.sleep(0.5)      # the router has started reading the body and waits for the rest


def test_a_client_hanging_up_mid_body_leaves_no_traceback_and_the_router_keeps_serving(router):
    before = router.log()
    for _ in range(3):
        send_half_a_body_and_hang_up(router.http)
    time.sleep(1)            # the router takes in each hang-up
    assert_serves(router)
    logged = router.log()[len(before):]
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged, logged




def test_json_nested_past_the_parsers_depth_is_400_and_the_router_keeps_serving(router):
    depth = 100_000
    response = router.post("/v1/completions", b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
    assert response.status_code == 400, response.text
    assert "not valid JSON" in response.json()["error"]["message"]
    assert_serves(router)


# --- fields that are not what they claim ---------------------------------------------------------------------
@pytest.mark.parametrize("logit_bias", [
    {"1" * 5000: 1}, {str(2**32): 1}, {"-1": 1}, {"five": 1}, {"1e3": 1},   # keys that are not token ids
    {"100000": 1},                                                          # a token id past the vocabulary
    {"5": 101}, {"5": -1000},                                               # biases out of [-100, 100]
])
def test_a_malformed_logit_bias_is_400_naming_it_and_the_router_keeps_serving(router, logit_bias):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        response = router.post(path, {**body, "logit_bias": logit_bias})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "logit_bias" and "logit_bias" in error["message"] and len(error["message"]) < 200
    assert_serves(router)


LONG = "a " * 100_000      # far more characters than the tiny model's 1024-token context can hold


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {**COMPLETION, "prompt": LONG}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),   # no max_tokens
])
def test_a_prompt_longer_than_the_context_can_hold_is_400_naming_it(router, path, body, field):
    response = router.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field} is ") and "characters" in error["message"]
    assert_serves(router)


def test_a_body_over_the_size_limit_is_413_and_the_router_keeps_serving(router):
    response = router.post("/v1/completions", {**COMPLETION, "prompt": "a" * (MAX_REQUEST_BYTES + 10)})
    assert response.status_code == 413, response.text
    assert "exceeds the limit" in response.json()["error"]["message"]
    assert_serves(router)


# --- clients that trickle their request in ------------------------------------------------------------------
def trickle(http: str, head: bytes, seconds: float = 30) -> bytes | None:
    """Send head, then one more byte every 0.25 s for up to `seconds`: all the router sends back before it closes
    the connection (b"": nothing), or None if it still waits for the rest."""
    host, port = http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(head)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if select.select([client], [], [], 0.25)[0]:
                return received_until_closed(client)
            with contextlib.suppress(OSError):   # the router closed its side first
                client.sendall(b"a")
    return None


def received_until_closed(client: socket.socket) -> bytes:
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := client.recv(65536):
            answer += chunk
    return answer


def test_a_body_trickling_in_past_the_body_timeout_is_408_and_others_are_served_meanwhile(router):
    before = router.log()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{\"prompt\": \"")
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(trickle, router.http, head)
        assert_serves(router)
        answer = slow.result()
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert b"request body not received within" in answer and b"connection: close" in answer.lower()
    assert "Traceback" not in router.log()[len(before):]


def test_a_connection_trickling_its_headers_in_past_the_header_timeout_is_closed(router):
    assert trickle(router.http, b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nX-Slow: ") == b""
    assert_serves(router)

