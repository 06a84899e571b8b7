"""/v1/embeddings' inputs (router/http/embeddings.py): a string, a list of them, a list of ids or a list of such lists
is one prompt each; text is tokenized with the tokenizer's special tokens unless the request says not (vLLM's
default for embeddings: Qwen3-Embedding pools at the EOS its tokenizer appends)."""
from __future__ import annotations

import asyncio

import pytest
from tokenizers.processors import TemplateProcessing

from router.http.app import embedding_prompt
from router.http.embeddings import EmbeddingRequest
from router.http.served_models import ServedModel
from router.tokenizer import RouterTokenizer


@pytest.mark.parametrize("given, prompts", [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([5, 6], [[5, 6]]),
                                            ([[5], [6, 7]], [[5], [6, 7]])])
def test_each_input_is_one_prompt(given, prompts):
    assert EmbeddingRequest(input=given).inputs == prompts


def test_text_gets_the_tokenizers_special_tokens_unless_told_not_to(tokenizer_dir):
    tokenizer = RouterTokenizer(tokenizer_dir)
    eos = tokenizer.tokenizer.token_to_id("</s>") or 0
    tokenizer.tokenizer.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    model = ServedModel("tiny", "", tokenizer, max_model_len=64)
    plain = tokenizer.encode("hello world")
    assert asyncio.run(embedding_prompt("hello world", True, model)) == plain + [eos]
    assert asyncio.run(embedding_prompt("hello world", False, model)) == plain
    assert asyncio.run(embedding_prompt([3, 4], True, model)) == [3, 4]   # ids are taken as they are
