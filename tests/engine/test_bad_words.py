"""vLLM's bad_words: a banned word never comes out, in any of its spellings, and the text before the point where
it would have is unchanged; with a grammar, the bans narrow it."""
from __future__ import annotations

import pytest

from base.sampling_params import SamplingParams
from base.structured_output import StructuredOutput
from scheduler.bad_words import BadWords, bad_word_token_ids
from tests.engine.test_engine import tiny_engine

PROMPT = "The quick brown fox jumps over the lazy dog"


def first_completion(token_ids: list[int], words: list[tuple[int, ...]]) -> int | None:
    """The index of the token that first completes one of the words, or None."""
    for end in range(len(token_ids)):
        if any(tuple(token_ids[end + 1 - len(ids):end + 1]) == ids for ids in words if len(ids) <= end + 1):
            return end
    return None


def test_a_words_last_token_is_banned_only_after_the_tokens_before_it():
    words = BadWords([(5,), (7, 8, 9)])
    assert words.banned_next() == [5]
    words.accept(7)
    assert words.banned_next() == [5]
    words.accept(8)
    assert words.banned_next() == [5, 9]
    words.accept(1)
    assert words.banned_next() == [5]


def test_a_word_is_banned_alone_and_after_a_space(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    spellings = bad_word_token_ids(tokenizer, ("fox",))
    assert sorted(tokenizer.decode(ids) for ids in spellings) == [" fox", "fox"]


def two_token_word(tokenizer, token_ids: list[int]) -> str:
    for i in range(len(token_ids) - 1):
        word = tokenizer.decode(token_ids[i:i + 2])
        if word.strip() == word and word.isalpha() and len(tokenizer.encode(word, add_special_tokens=False)) == 2:
            return word
    pytest.skip("the greedy output has no two-token word to ban")


def test_a_bad_word_never_comes_out_and_the_text_before_it_is_unchanged(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    params = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
    plain = engine.generate([PROMPT], SamplingParams(**params))[0].token_ids
    word = two_token_word(engine.tokenizer, plain)
    banned = bad_word_token_ids(engine.tokenizer, (word,))
    cut = first_completion(plain, banned)
    assert cut is not None
    result = engine.generate([PROMPT], SamplingParams(**params, bad_words=(word,)))[0].token_ids
    assert first_completion(result, banned) is None
    assert result[:cut] == plain[:cut] and result[cut] != plain[cut]


def one_token_words(tokenizer, count: int) -> list[str]:
    words = [tokenizer.decode([token_id]) for token_id in range(tokenizer.vocab_size)]
    return [w for w in words if w.isalpha() and len(tokenizer.encode(w, add_special_tokens=False)) == 1][:count]


def test_bad_words_narrow_a_grammar_and_give_way_when_it_has_no_other_token(tiny_llama_dir):
    """A ban clears the word's last token where the grammar branches; where the grammar allows nothing else (a
    multi-token word already begun, or a single choice), the grammar wins: the output always completes."""
    engine = tiny_engine(tiny_llama_dir)
    first, second = one_token_words(engine.tokenizer, 2)
    choice = StructuredOutput("choice", choices=(first, second))
    narrowed = engine.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0, max_tokens=8, structured_output=choice, bad_words=(first,)),
        SamplingParams(temperature=0, max_tokens=8, structured_output=choice, bad_words=(second,))])
    assert [r.text for r in narrowed] == [second, first]
    only = StructuredOutput("choice", choices=(first,))
    result = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, structured_output=only,
                                                      bad_words=(first,)))[0]
    assert result.text == first and result.finish_reason == "stop"


def test_bad_words_survive_the_wire_and_are_checked():
    params = SamplingParams(bad_words=("fox", "lazy dog"))
    assert SamplingParams.from_proto(params.to_proto()) == params
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=(" ",))
