"""What the OpenAI API tests share: a real router stack over the tiny model, one per test module, and what
transformers answers on that model."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.services_fixtures import start_http_stack


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with start_http_stack(tiny_llama_dir) as http_stack:
        yield http_stack


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return Reference(tiny_llama_dir)


class Reference:
    """Greedy decoding and logprobs straight from Hugging Face transformers."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer, LlamaForCausalLM

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])

    def greedy(self, prompt_ids: list[int], max_tokens: int, repetition_penalty: float = 1.0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> tuple[list[int], list[list[float]]]:
        """Token ids and, per generated token, the log-probabilities over the vocabulary (after penalties:
        repetition over prompt and output as in transformers, presence/frequency over the output as in OpenAI)."""
        from transformers import RepetitionPenaltyLogitsProcessor

        ids, logprobs = list(prompt_ids), []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                if repetition_penalty != 1.0:
                    logits = RepetitionPenaltyLogitsProcessor(repetition_penalty)(torch.tensor([ids]),
                                                                                 logits[None])[0]
                for token, count in Counter(ids[len(prompt_ids):]).items():
                    logits[token] -= frequency_penalty * count + presence_penalty
                row = torch.log_softmax(logits.float(), dim=-1)
                ids.append(int(row.argmax()))
                logprobs.append(row.tolist())
                if ids[-1] == self.tokenizer.eos_token_id:
                    break
        return ids[len(prompt_ids):], logprobs

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def rows(self, ids: list[int]) -> torch.Tensor:
        """Row i: log-probabilities of the token after ids[:i + 1]."""
        with torch.no_grad():
            return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)
