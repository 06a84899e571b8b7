"""Random-weight models saved as Hugging Face directories: real models' shapes with a tiny byte-level BPE tokenizer
trained on the spot, for benchmarks and checks on machines that cannot download weights (tests use it too)."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Continuous batching keeps the accelerator busy; paged attention keeps memory tight.",
    "Ünïcödé têxt, emoji 🚢⛴️ and 中文字符 must survive incremental detokenization.",
    "def hello(world):\n    return f'hello {world}'\n",
] * 20

# Llama-family shapes (transformers LlamaConfig fields) of real models, and the tests' tiny one; vocab_size None:
# the tokenizer's own, so that every sampled id decodes.
LLAMA_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=None, tie_word_embeddings=False, rope_theta=10000.0),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                       rope_theta=500000.0),
}


def build_tiny_tokenizer(path: Path, vocab_size: int = 512, chat_template: str = TINY_CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast


def save_random_llama(path: Path, shape: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                      seed: int = 0, weight_std: float = 0.0, **overrides) -> Path:
    """A Llama of a named shape (LLAMA_SHAPES) with random weights, built on `device` and saved in `dtype`;
    overrides replace shape fields. weight_std: the matrices drawn with it instead of the default init (larger
    weights make a tiny model's greedy output vary with the prompt)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer(path)
    fields = LLAMA_SHAPES[shape] | overrides
    if fields["vocab_size"] is None:
        fields["vocab_size"] = len(tokenizer)
    config = LlamaConfig(**fields, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, torch_dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    if weight_std:
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 2:
                    parameter.normal_(0.0, weight_std)
    model = model.to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path
