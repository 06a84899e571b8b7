"""The OpenAI-compatible HTTP API on a real router (redis-server, a scheduler with its worker, a router process
serving gRPC and HTTP), driven by the official `openai` client, and by raw HTTP where the wire is the point
(server-sent events). Its refusals and clients that hang up: test_openai_errors.py."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from protos import common_pb2, router_pb2
from router.http.app import create_app
from router.http.served_models import ServedModel
from router.tokenizer import RouterTokenizer
from tests.openai_fixtures import reference, stack
from tests.services_fixtures import API_KEY

__all__ = ["reference", "stack"]   # the shared fixtures


def sse_payloads(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# --- happy paths, with the openai client -------------------------------------------------------------------
def test_models_lists_the_served_model(stack):
    models = stack.client().models.list()
    assert [m.id for m in models.data] == [stack.model]


def test_greedy_completion_matches_transformers_with_usage(stack, reference):
    prompt = "Paris is the capital of France. The quick brown fox"
    want_ids, _ = reference.greedy(reference.encode(prompt), 20)
    result = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=20, temperature=0)
    assert result.choices[0].text == reference.decode(want_ids)
    assert result.choices[0].finish_reason == ("stop" if len(want_ids) < 20 else "length")
    assert result.usage.prompt_tokens == len(reference.encode(prompt))
    assert result.usage.completion_tokens == len(want_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_completion_prompt_as_token_ids(stack, reference):
    prompt_ids = reference.encode("Berlin is the capital of Germany.")
    want_ids, _ = reference.greedy(prompt_ids, 12)
    result = stack.client().completions.create(model=stack.model, prompt=prompt_ids, max_tokens=12, temperature=0)
    assert result.choices[0].text == reference.decode(want_ids)
    assert result.usage.prompt_tokens == len(prompt_ids)


def test_chat_completion_applies_the_chat_template(stack, reference):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    want_ids, _ = reference.greedy(reference.chat_ids(messages), 16)
    result = stack.client().chat.completions.create(model=stack.model, messages=messages, max_tokens=16,
                                                    temperature=0)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == reference.decode(want_ids)
    assert result.usage.prompt_tokens == len(reference.chat_ids(messages))
    assert result.usage.completion_tokens == len(want_ids)


def test_streamed_completion_deltas_concatenate_to_the_non_streamed_text_for_the_same_seed(stack):
    args = dict(model=stack.model, prompt="The quick brown fox", max_tokens=32, temperature=1.0, seed=1234)
    whole = stack.client().completions.create(**args)
    chunks = list(stack.client().completions.create(**args, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1    # streamed, not sent at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(stack, reference):
    messages = [{"role": "user", "content": "Count to ten."}]
    args = dict(model=stack.model, messages=messages, max_tokens=12, temperature=0, stream=True)
    chunks = list(stack.client().chat.completions.create(
        **args, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    prompt_tokens = len(reference.chat_ids(messages))
    tokens = [c for c in chunks[1:] if c.choices]   # past the role's opening chunk, sent before any token
    counts = [c.usage.completion_tokens for c in tokens]
    assert all(c.usage.prompt_tokens == prompt_tokens for c in tokens)
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == chunks[-1].usage.completion_tokens == 12
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in tokens)
    without = list(stack.client().chat.completions.create(**args, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in without)   # as vLLM: only with include_usage


def test_a_cache_salt_shares_a_prompts_kv_only_with_requests_of_the_same_salt(stack, reference):
    vocab_size = reference.model.config.vocab_size
    prompt = [int(t) for t in torch.randint(10, vocab_size, (80,), generator=torch.Generator().manual_seed(41))]
    want_ids, _ = reference.greedy(prompt, 4)

    def cached_tokens(salt: str | None) -> int:
        result = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=4, temperature=0,
                                                   extra_body={"cache_salt": salt} if salt else None)
        assert result.choices[0].text == reference.decode(want_ids)
        return result.usage.prompt_tokens_details.cached_tokens

    full_blocks = (len(prompt) - 1) // 16 * 16   # the last prompt token is always computed
    assert [cached_tokens(salt) for salt in ("tenant-a", "tenant-a", "tenant-b", None, None, "tenant-b")] == \
        [0, full_blocks, 0, 0, full_blocks, full_blocks]


def test_streamed_chat_deltas_concatenate_to_the_non_streamed_message_for_the_same_seed(stack):
    args = dict(model=stack.model, messages=[{"role": "user", "content": "Tell me about Berlin."}],
                max_completion_tokens=32, temperature=0.8, top_p=0.9, seed=7)
    whole = stack.client().chat.completions.create(**args)
    chunks = list(stack.client().chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_penalties_reach_the_sampler_token_exact_against_transformers(stack, reference):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7)
    want_ids, _ = reference.greedy(reference.encode(prompt), 24, **penalties)
    plain_ids, _ = reference.greedy(reference.encode(prompt), 24)
    assert want_ids != plain_ids
    result = stack.client().completions.create(
        model=stack.model, prompt=prompt, max_tokens=24, temperature=0,
        presence_penalty=penalties["presence_penalty"], frequency_penalty=penalties["frequency_penalty"],
        extra_body={"repetition_penalty": penalties["repetition_penalty"]})
    assert result.choices[0].text == reference.decode(want_ids)


@pytest.mark.parametrize("narrowing", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}])
def test_top_k_min_p_and_top_p_narrow_sampling_down_to_greedy(stack, reference, narrowing):
    prompt = "Berlin is the capital of"
    want_ids, _ = reference.greedy(reference.encode(prompt), 16)
    result = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=16, temperature=1.5,
                                               seed=5, extra_body=narrowing)
    assert result.choices[0].text == reference.decode(want_ids)


def test_chat_without_max_tokens_may_fill_the_context(stack, reference):
    messages = [{"role": "user", "content": "Write a long story."}]
    max_model_len = httpx.get(stack.base_url + "/models", headers={"Authorization": f"Bearer {API_KEY}"}
                              ).json()["data"][0]["max_model_len"]
    result = stack.client().chat.completions.create(model=stack.model, messages=messages, temperature=0,
                                                    extra_body={"ignore_eos": True})
    assert result.usage.prompt_tokens == len(reference.chat_ids(messages))
    assert result.usage.completion_tokens == max_model_len - result.usage.prompt_tokens
    assert result.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_is_rendered_and_tokenized_once(tokenizer_dir, monkeypatch):
    tokenizer = RouterTokenizer(tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    renders, sent = [], []
    render = tokenizer.render_chat
    monkeypatch.setattr(tokenizer, "render_chat", lambda *args: renders.append(args) or render(*args))

    async def generate(request, **_):
        sent.append(request)
        yield router_pb2.GenerateResponse(index=0, text="ok", finish_reason=common_pb2.FINISH_REASON_LENGTH)

    app = create_app(generate, models=lambda: [ServedModel("tiny", "", tokenizer, max_model_len=64)])
    response = TestClient(app).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200, response.text
    prompt_ids = tokenizer.encode("<user>hi<assistant>")
    assert len(renders) == 1 and list(sent[0].token_ids.ids) == prompt_ids   # the router takes the ids as they are
    assert sent[0].sampling.max_tokens == 64 - len(prompt_ids)


def test_force_include_usage_gives_every_stream_its_usage_as_if_asked(tokenizer_dir):
    sent = []

    async def generate(request, **_):
        sent.append(request)
        for count, finish in ((1, 0), (2, common_pb2.FINISH_REASON_LENGTH)):
            yield router_pb2.GenerateResponse(index=0, text="ok", finish_reason=finish,
                                              usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=count))

    def streamed_usage(force: bool) -> list:
        models = lambda: [ServedModel("tiny", "", RouterTokenizer(tokenizer_dir), max_model_len=64)]  # noqa: E731
        app = create_app(generate, models=models, force_include_usage=force)
        response = TestClient(app).post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert response.status_code == 200, response.text
        return [json.loads(p).get("usage", "absent") for p in sse_payloads(response) if p != "[DONE]"]

    assert streamed_usage(False) == ["absent", "absent"] and not sent[0].continuous_usage
    forced = streamed_usage(True)
    assert sent[1].continuous_usage
    assert [u["completion_tokens"] for u in forced] == [1, 2, 2]   # each chunk's, then the usage chunk
    assert all(u["prompt_tokens"] == 3 for u in forced)


def test_embeddings_are_transformers_last_hidden_state_normalized(stack, reference):
    """Texts tokenized with the tokenizer's special tokens (vLLM's default for embeddings); ids taken as given."""
    texts = ["Paris is the capital of France.", "The quick brown fox"]
    ids = [reference.tokenizer.encode(text, add_special_tokens=True) for text in texts]
    with torch.no_grad():
        want = [torch.nn.functional.normalize(reference.model.model(torch.tensor([p])).last_hidden_state[0, -1],
                                              dim=-1) for p in ids]
    result = stack.client().embeddings.create(model=stack.model, input=texts)   # base64, as the client asks
    assert [d.index for d in result.data] == [0, 1] and result.model == stack.model
    for got, wanted in zip(result.data, want):
        assert torch.allclose(torch.tensor(got.embedding), wanted, atol=1e-5)
    assert result.usage.prompt_tokens == sum(len(p) for p in ids)
    as_ids = httpx.post(stack.base_url + "/embeddings", json={"input": ids[1]}, timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()   # floats; one list of ids: one input
    assert len(as_ids["data"]) == 1 and torch.allclose(torch.tensor(as_ids["data"][0]["embedding"]), want[1],
                                                       atol=1e-5)


def test_score_and_rerank_are_the_cosine_similarity_of_transformers_embeddings(stack, reference):
    query, documents = "Where is Paris?", ["Paris is in France.", "The quick brown fox", "Berlin is in Germany."]
    with torch.no_grad():
        vectors = [torch.nn.functional.normalize(reference.model.model(torch.tensor(
            [reference.tokenizer.encode(text, add_special_tokens=True)])).last_hidden_state[0, -1], dim=-1)
            for text in [query, *documents]]
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    scored = post_root(stack, "/score", {"model": stack.model, "text_1": query, "text_2": documents}).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-4)
    pairwise = post_root(stack, "/v1/score", {"text_1": documents[:2], "text_2": documents[1:]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [float(vectors[1] @ vectors[2]), float(vectors[2] @ vectors[3])], abs=1e-4)
    reranked = post_root(stack, "/rerank", {"query": query, "documents": documents, "top_n": 2}).json()
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in reranked["results"]] == best
    assert [r["document"]["text"] for r in reranked["results"]] == [documents[i] for i in best]
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx([want[i] for i in best], abs=1e-4)


def post_root(stack, path: str, body: dict) -> httpx.Response:
    """vLLM's routes outside /v1 (/tokenize, /detokenize)."""
    return httpx.post(stack.base_url.removesuffix("/v1") + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def test_tokenize_gives_the_ids_a_completion_and_a_chat_run_and_detokenize_gives_the_text_back(stack, reference):
    prompt = "Paris is the capital of France."
    tokenized = post_root(stack, "/tokenize", {"model": stack.model, "prompt": prompt, "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["tokens"] == reference.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0 and len(body["token_strs"]) == body["count"]
    usage = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    assert post_root(stack, "/detokenize", {"model": stack.model, "tokens": body["tokens"]}).json() == {
        "prompt": prompt}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = post_root(stack, "/tokenize", {"model": stack.model, "messages": messages}).json()
    assert chat["tokens"] == reference.chat_ids(messages)
    usage = stack.client().chat.completions.create(model=stack.model, messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"]


def test_a_chat_continues_its_last_message_as_transformers_and_tokenize_shows_that_prompt(stack, reference):
    """vLLM's continue_final_message: the prompt ends inside the assistant's message, which the model goes on with."""
    messages = [{"role": "user", "content": "Name a capital."}, {"role": "assistant", "content": "Paris is the"}]
    prompt_ids = list(reference.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True,
                                                              return_dict=True)["input_ids"])
    options = {"continue_final_message": True, "add_generation_prompt": False}
    tokenized = post_root(stack, "/tokenize", {"model": stack.model, "messages": messages, **options}).json()
    assert tokenized["tokens"] == prompt_ids
    want_ids, _ = reference.greedy(prompt_ids, 8)
    chat = stack.client().chat.completions.create(model=stack.model, messages=messages, max_tokens=8, temperature=0,
                                                  extra_body=options)
    assert chat.choices[0].message.content == reference.decode(want_ids)
    assert chat.usage.prompt_tokens == len(prompt_ids)
    opened = post_root(stack, "/tokenize", {"model": stack.model, "messages": messages,
                                            "add_generation_prompt": False}).json()
    assert opened["tokens"] == list(reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=True, return_dict=True)["input_ids"]) != prompt_ids


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": True,
                   "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}],
                              "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}],
                              "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_bodies_by_field_and_go_on_serving(stack, path, body, field):
    response = post_root(stack, path, body)
    assert response.status_code == 400, response.text
    assert field in response.text
    assert post_root(stack, "/tokenize", {"prompt": "still here"}).status_code == 200


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(stack, reference):
    """vLLM's: a prompt longer than the context runs from its last k tokens, as if only those were sent."""
    max_model_len = httpx.get(stack.base_url + "/models", headers={"Authorization": f"Bearer {API_KEY}"}
                              ).json()["data"][0]["max_model_len"]
    prompt_ids = (reference.encode("Paris is the capital of France. ") * max_model_len)[:max_model_len + 40]
    want_ids, _ = reference.greedy(prompt_ids[-24:], 8)
    result = stack.client().completions.create(model=stack.model, prompt=prompt_ids, max_tokens=8, temperature=0,
                                               extra_body={"truncate_prompt_tokens": 24})
    assert result.usage.prompt_tokens == 24 and result.choices[0].text == reference.decode(want_ids)
    whole = stack.client().completions.create(model=stack.model, prompt=prompt_ids, max_tokens=8, temperature=0,
                                              extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == max_model_len - 8
    messages = [{"role": "user", "content": "Paris is the capital of France. " * 40}]
    chat = stack.client().chat.completions.create(model=stack.model, messages=messages, temperature=0,
                                                  extra_body={"truncate_prompt_tokens": 24})
    assert chat.usage.prompt_tokens == 24 and chat.usage.completion_tokens > 0
    refused = stack.post("/completions", {"model": stack.model, "prompt": "hi", "truncate_prompt_tokens": 0})
    assert refused.status_code == 400 and "truncate_prompt_tokens" in refused.text


def test_a_batch_of_prompts_answers_each_prompts_samples_in_order_with_the_usage_summed(stack, reference):
    """OpenAI's prompt as a list (lm-eval-harness sends batches): prompt i's sample j is choice i * n + j."""
    prompts = ["Paris is the capital of", "The quick brown fox", "Berlin is"]
    wanted = [reference.decode(reference.greedy(reference.encode(p), 6)[0]) for p in prompts]
    result = stack.client().completions.create(model=stack.model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in result.choices] == list(range(6))
    assert [c.text for c in result.choices] == [text for text in wanted for _ in range(2)]
    assert result.usage.prompt_tokens == sum(len(reference.encode(p)) for p in prompts)
    assert result.usage.completion_tokens == sum(len(reference.greedy(reference.encode(p), 6)[0]) for p in prompts) * 2
    as_ids = stack.client().completions.create(model=stack.model, prompt=[reference.encode(p) for p in prompts],
                                               max_tokens=6, temperature=0)
    assert [c.text for c in as_ids.choices] == wanted
    streamed: dict[int, str] = {}
    chunks = list(stack.client().completions.create(model=stack.model, prompt=prompts, max_tokens=6, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == wanted
    assert chunks[-1].usage.prompt_tokens == result.usage.prompt_tokens
    assert len({chunk.id for chunk in chunks}) == 1


def test_stop_token_ids_end_the_completion(stack, reference):
    prompt = "Paris is the capital of France. The quick brown fox"
    want_ids, _ = reference.greedy(reference.encode(prompt), 20)
    stop_id = want_ids[5]
    result = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=20, temperature=0,
                                               extra_body={"stop_token_ids": [stop_id]})
    cut = want_ids.index(stop_id)
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens == cut + 1
    assert result.choices[0].text == reference.decode(want_ids[:cut])   # the stop token's text left out, as vLLM
    assert result.choices[0].model_extra["stop_reason"] == str(stop_id)


def test_concurrent_streams_each_get_their_own_tokens(stack, reference):
    prompts = [f"Paris is the capital of France {i}. The quick brown fox" for i in range(8)]
    expected = [reference.decode(reference.greedy(reference.encode(p), 12)[0]) for p in prompts]

    def stream(prompt: str) -> str:
        chunks = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=12, temperature=0,
                                                   stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(stream, prompts)) == expected


def test_stream_is_server_sent_events_ending_with_done(stack):
    body = {"model": stack.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", stack.base_url + "/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    assert all(json.loads(p)["object"] == "text_completion" for p in payloads[:-1])


def test_n2_gives_two_seeded_samples_and_usage_counts_both(stack):
    args = dict(model=stack.model, prompt="Continuous batching keeps", max_tokens=16, temperature=1.0, seed=99,
                n=2, extra_body={"ignore_eos": True})
    result = stack.client().completions.create(**args)
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.choices[0].text != result.choices[1].text
    assert result.usage.completion_tokens == 32
    again = stack.client().completions.create(**args)
    assert [c.text for c in again.choices] == [c.text for c in result.choices]
    streamed = {0: "", 1: ""}
    for chunk in stack.client().completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in result.choices]


def test_completion_logprobs_match_transformers(stack, reference):
    prompt = "Paris is the capital of"
    want_ids, want_rows = reference.greedy(reference.encode(prompt), 8)
    result = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=8, temperature=0,
                                               logprobs=3)
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == [reference.tokenizer.decode([t]) for t in want_ids]
    assert logprobs.token_logprobs == pytest.approx([row[t] for t, row in zip(want_ids, want_rows)], abs=1e-3)
    for top, row in zip(logprobs.top_logprobs, want_rows):
        best = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:3]
        want = {reference.tokenizer.decode([t]): row[t] for t in best}   # OpenAI's shape: tokens as dict keys
        assert top == pytest.approx(want, abs=1e-3)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[1:] == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(1, len(want_ids))]


def test_chat_logprobs_with_top_logprobs_and_bytes(stack, reference):
    messages = [{"role": "user", "content": "Ünïcödé têxt and emoji"}]
    want_ids, want_rows = reference.greedy(reference.chat_ids(messages), 10)
    result = stack.client().chat.completions.create(model=stack.model, messages=messages, max_tokens=10,
                                                    temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([row[t] for t, row in zip(want_ids, want_rows)], abs=1e-3)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5) for c in content)   # greedy
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", errors="replace") == reference.tokenizer.decode(want_ids, skip_special_tokens=False)


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(stack, reference):
    """vLLM's: tokens whose text does not tell them apart (half a character, say) named "token_id:{id}"."""
    prompt = "Paris is the capital of"
    want_ids, _ = reference.greedy(reference.encode(prompt), 6)
    as_ids = {"return_tokens_as_token_ids": True}
    completion = stack.client().completions.create(model=stack.model, prompt=prompt, max_tokens=6, temperature=0,
                                                   logprobs=2, extra_body=as_ids).choices[0]
    assert completion.logprobs.tokens == [f"token_id:{t}" for t in want_ids]
    assert all(key.startswith("token_id:") for top in completion.logprobs.top_logprobs for key in top)
    assert completion.text == reference.decode(want_ids)   # the text itself as ever
    messages = [{"role": "user", "content": "Ünïcödé"}]
    chat_ids, _ = reference.greedy(reference.chat_ids(messages), 6)
    content = stack.client().chat.completions.create(model=stack.model, messages=messages, max_tokens=6,
                                                     temperature=0, logprobs=True, top_logprobs=1,
                                                     extra_body=as_ids).choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat_ids]
    assert [bytes(c.bytes).decode() for c in content] == [c.token for c in content]
    assert all(c.top_logprobs[0].token == c.token for c in content)   # greedy


def split_stop_string(reference, prompt: str, max_tokens: int) -> tuple[str, str]:
    """A stop string that straddles two tokens of the greedy output, and that output's full text."""
    token_ids, _ = reference.greedy(reference.encode(prompt), max_tokens)
    full = reference.decode(token_ids)
    for i in range(1, len(token_ids) - 1):
        head, tail = reference.decode(token_ids[:i]), reference.decode(token_ids[i:i + 1])
        if not full.startswith(head + tail):
            continue
        for before, after in ((2, 2), (1, 2), (2, 1)):
            stop = head[-before:] + tail[:after]
            if len(stop) == before + after and "\ufffd" not in stop and full.find(stop) == len(head) - before:
                return stop, full
    raise AssertionError("no stop string straddling a token boundary in the greedy output")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens_is_caught_and_never_streamed(stack, reference, stream):
    prompt = "The quick brown fox jumps over the lazy dog."
    stop, full = split_stop_string(reference, prompt, 40)
    args = dict(model=stack.model, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "never seen"])
    if not stream:
        result = stack.client().completions.create(**args)
        assert result.choices[0].text == full[:full.index(stop)]
        assert result.choices[0].finish_reason == "stop"
        assert result.choices[0].model_extra["stop_reason"] == stop
        return
    deltas = [c.choices[0].text for c in stack.client().completions.create(**args, stream=True) if c.choices]
    assert "".join(deltas) == full[:full.index(stop)]
    assert not any(stop in "".join(deltas[:i + 1]) for i in range(len(deltas)))


def test_chat_stop_string_ends_the_message(stack, reference):
    messages = [{"role": "user", "content": "Paris is the capital of France."}]
    token_ids, _ = reference.greedy(reference.chat_ids(messages), 24)
    full = reference.decode(token_ids)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    result = stack.client().chat.completions.create(model=stack.model, messages=messages, max_tokens=24,
                                                    temperature=0, stop=stop)
    assert result.choices[0].message.content == full[:full.index(stop)]
    assert result.choices[0].finish_reason == "stop"
