"""/v1/completions `echo` (the prompt, and with logprobs its scoring, before the completion), `max_tokens: 0` scoring
as lm-eval-harness sends it, vLLM's `prompt_logprobs`, prompt logprobs on gRPC Router.Generate, and `suffix`
(fill-in-the-middle), on a real router over the tiny model, against transformers."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from tokenizers import AddedToken, Tokenizer

from protos import common_pb2, router_pb2, router_pb2_grpc
from router.http.app import create_app
from router.http.fill_in_middle import fim_prompt
from router.http.served_models import ServedModel
from router.tokenizer import RouterTokenizer
from tests.conftest import build_tiny_tokenizer
from tests.openai_fixtures import reference, stack
from tests.services_fixtures import API_KEY, collect, greedy, wait_until

__all__ = ["reference", "stack"]   # the shared fixtures

PROMPT = "Paris is the capital of"


def completion(stack, **body) -> dict:
    response = stack.post("/completions", {"model": stack.model, "prompt": PROMPT, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def streamed_choice(stack, **body) -> tuple[list[dict], str, dict]:
    """The stream's chunks, its text and its logprobs, each concatenated."""
    response = stack.post("/completions", {"model": stack.model, "prompt": PROMPT, "temperature": 0, "stream": True,
                                           **body})
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key, values in (chunk["choices"][0]["logprobs"] or {}).items():
            logprobs[key].extend(values)
    return chunks, "".join(c["choices"][0]["text"] for c in chunks), logprobs


def test_echo_puts_the_scored_prompt_before_the_completion(stack, reference):
    ids = reference.encode(PROMPT)
    plain = completion(stack, max_tokens=3)["choices"][0]
    choice = completion(stack, max_tokens=3, echo=True, logprobs=2)["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    logprobs = choice["logprobs"]
    rows = reference.rows(ids)
    assert logprobs["tokens"][:len(ids)] == [reference.text(t) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx([rows[i - 1, t].item() for i, t in
                                                                   enumerate(ids) if i], abs=1e-3)
    for top, row in zip(logprobs["top_logprobs"][1:len(ids)], rows):
        values, best = row.topk(2)
        assert top == pytest.approx({reference.text(t): v for t, v in zip(best.tolist(), values.tolist())}, abs=1e-3)
    assert len(logprobs["tokens"]) == len(ids) + 3
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(ids) + 3)]
    assert stack.idle()


def test_echo_with_max_tokens_0_returns_only_the_prompt_scoring(stack, reference):
    ids = reference.encode(PROMPT)
    result = completion(stack, max_tokens=0, echo=True, logprobs=0)
    choice = result["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [reference.text(t) for t in ids]
    assert choice["logprobs"]["token_logprobs"][0] is None
    rows = reference.rows(ids)
    assert sum(choice["logprobs"]["token_logprobs"][1:]) == pytest.approx(
        sum(rows[i - 1, t].item() for i, t in enumerate(ids) if i), abs=1e-3)
    assert result["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_sends_the_prompt_in_the_first_chunk_and_matches_the_whole_body(stack, max_tokens):
    whole = completion(stack, max_tokens=max_tokens, echo=True, logprobs=1)["choices"][0]
    chunks, text, logprobs = streamed_choice(stack, max_tokens=max_tokens, echo=True, logprobs=1)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert text == whole["text"]
    assert logprobs["tokens"] == whole["logprobs"]["tokens"]
    assert logprobs["text_offset"] == whole["logprobs"]["text_offset"]
    assert logprobs["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_without_logprobs_and_with_n_echoes_every_choice(stack):
    result = completion(stack, max_tokens=2, echo=True, n=2, temperature=1, seed=3)
    assert [c["text"][:len(PROMPT)] for c in result["choices"]] == [PROMPT, PROMPT]
    assert all(c["logprobs"] is None for c in result["choices"])


def test_vllm_prompt_logprobs_field(stack, reference):
    ids = reference.encode(PROMPT)
    choice = completion(stack, max_tokens=1, prompt_logprobs=1)["choices"][0]
    scored = choice["prompt_logprobs"]
    rows = reference.rows(ids)
    assert scored[0] is None and len(scored) == len(ids)
    for i, entry in enumerate(scored[1:], start=1):
        assert entry[str(ids[i])]["logprob"] == pytest.approx(rows[i - 1, ids[i]].item(), abs=1e-3)
        assert entry[str(ids[i])]["decoded_token"] == reference.text(ids[i])
        assert str(int(rows[i - 1].argmax())) in entry
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)


def test_grpc_generate_returns_prompt_logprobs_once(stack, reference):
    ids = reference.encode(PROMPT)
    stub = router_pb2_grpc.RouterStub(stack.services.channel(stack.grpc_address))
    request = router_pb2.GenerateRequest(text=PROMPT, sampling=greedy(3, prompt_logprobs=0, n=2))
    _, _, messages = collect(stub.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {API_KEY}"),)))
    carrying = [m for m in messages if m.prompt_token_ids]
    assert len(carrying) == 1 and list(carrying[0].prompt_token_ids) == ids
    rows = reference.rows(ids)
    assert [e.logprob for e in carrying[0].prompt_logprobs] == pytest.approx(
        [rows[i - 1, t].item() for i, t in enumerate(ids) if i], abs=1e-3)
    wait_until(stack.idle, "every block free")


def test_suffix_without_fill_in_the_middle_tokens_is_400(stack):
    response = stack.post("/completions", {"model": stack.model, "prompt": "def f(", "suffix": "    return x\n"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "suffix" and "fill-in-the-middle" in error["message"]


# --- fill-in-the-middle on a tokenizer that has the tokens ------------------------------------------------------
@pytest.fixture(scope="module", params=[("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                                        ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")])
def fim_tokenizer(request, tmp_path_factory) -> tuple[RouterTokenizer, list[int]]:
    path = tmp_path_factory.mktemp("fim-tokenizer")
    build_tiny_tokenizer(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in request.param])
    tokenizer.save(str(path / "tokenizer.json"))
    return RouterTokenizer(str(path)), [tokenizer.token_to_id(name) for name in request.param]


def test_fim_prompt_is_prefix_suffix_middle(fim_tokenizer):
    tokenizer, (prefix, suffix, middle) = fim_tokenizer
    ids = fim_prompt("def f(x):\n", "    return y\n", tokenizer)
    assert ids == [prefix, *tokenizer.encode("def f(x):\n"), suffix, *tokenizer.encode("    return y\n"), middle]
    assert fim_prompt([5, 6], "y", tokenizer) == [prefix, 5, 6, suffix, *tokenizer.encode("y"), middle]


def test_completions_send_the_fim_prompt_upstream(fim_tokenizer, tokenizer_dir):
    tokenizer, (prefix, suffix, middle) = fim_tokenizer
    sent: list[router_pb2.GenerateRequest] = []

    async def generate(request, **_):
        sent.append(request)
        yield router_pb2.GenerateResponse(index=0, text="x = 1",
                                          finish_reason=common_pb2.FINISH_REASON_LENGTH)

    with_fim = TestClient(create_app(generate, models=lambda: [ServedModel("fim", "", tokenizer)]))
    response = with_fim.post("/v1/completions", json={"prompt": "a = ", "suffix": "\nb = 2", "echo": True})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "a = x = 1"
    assert list(sent[0].token_ids.ids) == [prefix, *tokenizer.encode("a = "), suffix, *tokenizer.encode("\nb = 2"),
                                           middle]
    plain = ServedModel("plain", "", RouterTokenizer(tokenizer_dir))
    without = TestClient(create_app(generate, models=lambda: [plain]))
    assert without.post("/v1/completions", json={"prompt": "a = ", "suffix": "b"}).status_code == 400
