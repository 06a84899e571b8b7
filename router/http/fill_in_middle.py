"""`suffix` on /v1/completions: the prompt rewritten in prefix-suffix-middle order with the model's own
fill-in-the-middle tokens, for the models trained with them (StarCoder / SmolLM style, Qwen's `<|fim_...|>`)."""
from __future__ import annotations

from router.tokenizer import RouterTokenizer

FIM_TOKEN_NAMES = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                   ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


class NoFillInTheMiddle(ValueError):
    pass


def fim_token_ids(tokenizer: RouterTokenizer) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids of the first naming the tokenizer knows whole; None if it knows none."""
    for names in FIM_TOKEN_NAMES:
        ids = [tokenizer.tokenizer.token_to_id(name) for name in names]
        if None not in ids:
            return ids[0], ids[1], ids[2]
    return None


def fim_prompt(prompt: str | list[int], suffix: str, tokenizer: RouterTokenizer) -> list[int]:
    """The token ids `<prefix> prompt <suffix> suffix <middle>`: the model writes what goes between them."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        raise NoFillInTheMiddle("suffix is not supported: this model has no fill-in-the-middle tokens")
    prefix, suffix_id, middle = ids
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return [prefix, *prompt_ids, suffix_id, *tokenizer.encode(suffix), middle]
