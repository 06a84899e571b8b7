"""The router's incremental detokenizer and stop strings, against the real tiny tokenizer and a Llama-style
(sentencepiece) one (no processes)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.registration import SchedulerInfo
from router.detokenizer import IncrementalDetokenizer, held_back_length
from router.policy import RoutingInput, least_loaded
from router.tokenizer import RouterTokenizer

TEXT = "Ünïcödé têxt, emoji 🚢⛴️ and 中文字符 must survive incremental detokenization."
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
          "Continuous batching keeps the accelerator busy; paged attention keeps memory tight.", TEXT,
          "def hello(world):\n    return f'hello {world}'\n"] * 20


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> RouterTokenizer:
    return RouterTokenizer(str(tiny_llama_dir))


def build_llama_style_tokenizer(path) -> None:
    """Llama 2's tokenizer.json shape: spaces as "▁" (one prepended, stripped again on decode), byte fallback
    tokens <0x00>..<0xFF>, so a token decodes differently alone than after another."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, limit_alphabet=40, max_token_length=5,
                                                        special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    learned = [piece for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])]
    pieces = learned[:3] + [f"<0x{b:02X}>" for b in range(256)] + learned[3:]
    spec["model"]["vocab"] = {piece: i for i, piece in enumerate(pieces)}
    (path / "tokenizer.json").write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def llama_style_tokenizer(tmp_path_factory) -> RouterTokenizer:
    path = tmp_path_factory.mktemp("llama-style-tokenizer")
    build_llama_style_tokenizer(path)
    return RouterTokenizer(str(path))


@pytest.fixture(params=["byte_level", "llama_style"])
def any_tokenizer(request, tokenizer, llama_style_tokenizer) -> RouterTokenizer:
    return tokenizer if request.param == "byte_level" else llama_style_tokenizer


def whole_tokens(tokenizer: RouterTokenizer) -> list[int]:
    """Ids of all tokens but the single bytes: a stray byte token can turn text already decoded (and streamed)
    into U+FFFD, which no streaming detokenizer can take back."""
    return [i for piece, i in tokenizer.tokenizer.get_vocab().items() if not piece.startswith("<0x")]


def stream(tokenizer, token_ids, chunks, stops=()):
    detok = IncrementalDetokenizer(tokenizer.decode, tuple(stops))
    deltas, i = [], 0
    for size in chunks:
        piece = token_ids[i:i + size]
        i += size
        delta = detok.add(piece, final=i >= len(token_ids))
        deltas.append(delta)
        if delta.stop_string or i >= len(token_ids):
            break
    return deltas


def test_router_tokenizer_matches_transformers(tokenizer, tiny_llama_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = reference(TEXT, add_special_tokens=False).input_ids
    assert tokenizer.encode(TEXT) == ids
    assert tokenizer.decode(ids + [reference.eos_token_id]) == reference.decode(ids + [reference.eos_token_id],
                                                                                 skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    assert tokenizer.encode_chat(chat) == list(reference.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_the_full_text_and_never_split_a_character(tokenizer, data):
    token_ids = data.draw(st.lists(st.integers(0, 455), min_size=1, max_size=40)) if data.draw(st.booleans()) \
        else tokenizer.encode(TEXT)
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(token_ids), max_size=len(token_ids)))
    deltas = stream(tokenizer, token_ids, chunks)
    assert "".join(d.text for d in deltas) == tokenizer.decode(token_ids)
    if "\ufffd" not in tokenizer.decode(token_ids):
        assert all(not d.text.endswith("\ufffd") for d in deltas)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_the_full_text_for_a_llama_style_tokenizer(llama_style_tokenizer, data):
    tokenizer = llama_style_tokenizer
    vocab = whole_tokens(tokenizer)
    token_ids = []
    for piece in data.draw(st.lists(st.one_of(st.text(max_size=12), st.integers(0, len(vocab) - 1)), min_size=1,
                                     max_size=12)):
        token_ids += tokenizer.encode(piece) if isinstance(piece, str) else [vocab[piece]]
    if not token_ids:
        token_ids = tokenizer.encode(TEXT)
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(token_ids), max_size=len(token_ids)))
    deltas = stream(tokenizer, token_ids, chunks)
    assert "".join(d.text for d in deltas) == tokenizer.decode(token_ids)
    if "\ufffd" not in tokenizer.decode(token_ids):
        assert all(not d.text.endswith("\ufffd") for d in deltas)


def test_spaces_survive_one_token_at_a_time_with_a_llama_style_tokenizer(llama_style_tokenizer):
    text = " leading and  double spaces,\n a newline and emoji 🚢 between words "
    token_ids = llama_style_tokenizer.encode(text)
    deltas = stream(llama_style_tokenizer, token_ids, [1] * len(token_ids))
    assert "".join(d.text for d in deltas) == llama_style_tokenizer.decode(token_ids) == text


def test_each_step_decodes_only_a_few_trailing_tokens(any_tokenizer):
    token_ids = any_tokenizer.encode(TEXT) * 20
    windows = []

    def decode(ids: list[int]) -> str:
        windows.append(len(ids))
        return any_tokenizer.decode(ids)

    detok = IncrementalDetokenizer(decode)
    text = "".join(detok.add([t], final=False).text for t in token_ids)
    assert max(windows) <= 8
    assert text + detok.add([], final=True).text == any_tokenizer.decode(token_ids)


@pytest.mark.parametrize("stop", ["emoji", "中文", "🚢", "tion.", "ïc"])
def test_stop_string_split_across_tokens_is_caught_and_never_streamed(any_tokenizer, stop):
    tokenizer = any_tokenizer
    token_ids = tokenizer.encode(TEXT)
    deltas = stream(tokenizer, token_ids, [1] * len(token_ids), stops=[stop, "never there"])
    assert deltas[-1].stop_string == stop
    streamed = "".join(d.text for d in deltas)
    assert streamed == TEXT[:TEXT.index(stop)]


def test_held_back_length_is_the_longest_possible_stop_start():
    assert held_back_length("hello wor", ("world",)) == 3
    assert held_back_length("hello", ("xyz",)) == 0
    assert held_back_length("abcab", ("abcabd", "b")) == 5


def info(scheduler_id: str, running: int) -> SchedulerInfo:
    return SchedulerInfo(scheduler_id, f"{scheduler_id}:1", "m", "/m", 16, 1024, 512, num_running=running)


def test_least_loaded_prefers_idle_schedulers_and_keeps_equal_prefixes_together():
    busy, idle_a, idle_b = info("busy", 5), info("a", 0), info("b", 0)
    first = [least_loaded([busy, idle_a, idle_b], RoutingInput([1] * 32, [h, h + 1], {}))[0].scheduler_id
             for h in range(200)]
    assert "busy" not in first and {"a", "b"} == set(first)   # ties spread by the prefix hash
    again = [least_loaded([idle_b, idle_a, busy], RoutingInput([1] * 32, [h, h + 7], {}))[0].scheduler_id
             for h in range(200)]
    assert first == again                                     # same first block, same scheduler


def test_router_never_imports_torch():
    import subprocess
    import sys

    code = "import sys, router.process, router.__main__; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_chat_template_is_compiled_once_per_tokenizer_and_renders_as_before(tiny_llama_dir, monkeypatch):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    compiled = []
    compile_template = ImmutableSandboxedEnvironment.from_string

    def counted(env, source, *args, **kwargs):
        compiled.append(source)
        return compile_template(env, source, *args, **kwargs)

    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string", counted)
    tokenizer = RouterTokenizer(str(tiny_llama_dir))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    first, again = tokenizer.render_chat(chat), tokenizer.render_chat(chat)
    other = tokenizer.render_chat([{"role": "user", "content": "Another question?"}])
    assert len(compiled) == 1
    assert first == again and TEXT in first and "Another question?" in other and TEXT not in other


def unreadable_token(tokenizer: RouterTokenizer) -> int:
    """A token that decodes to U+FFFD alone and in any run of itself (a lone UTF-8 continuation byte)."""
    return next(i for i in sorted(tokenizer.tokenizer.get_vocab().values())
                if tokenizer.decode([i]) == "\ufffd" and tokenizer.decode([i] * 8) == "\ufffd" * 8)


def skipped_special_token(tokenizer: RouterTokenizer) -> int:
    return next(i for i, token in sorted(tokenizer.tokenizer.get_added_tokens_decoder().items())
                if token.special and tokenizer.decode([i]) == "")


@pytest.mark.parametrize("run_of", [unreadable_token, skipped_special_token])
@pytest.mark.parametrize("stops", [(), ("never there",)])
def test_a_long_run_of_tokens_without_readable_text_is_detokenized_in_linear_time(any_tokenizer, run_of, stops):
    """A run of tokens that decode to U+FFFD or to nothing (logit_bias can force one) moves the window on: each
    step decodes a few trailing tokens, not the whole run again; the text is still exactly the full decode."""
    tokenizer, run = any_tokenizer, 2000
    token_ids = tokenizer.encode("Hello ") + [run_of(tokenizer)] * run + tokenizer.encode(" bye")
    decoded = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return tokenizer.decode(ids)

    detok = IncrementalDetokenizer(decode, stops)
    text = "".join(detok.add([t]).text for t in token_ids) + detok.add([], final=True).text
    assert text == tokenizer.decode(token_ids)
    assert max(decoded[:-1]) <= 8 and sum(decoded) < 20 * len(token_ids)   # the last decode: the final, of all


def test_a_character_cut_at_the_end_of_a_long_chunk_is_sent_only_when_whole(tokenizer):
    token_ids = tokenizer.encode("A dozen plain words come first, then 鵬𓀀ꙮ and the end.")
    cuts = [n for n in range(1, len(token_ids)) if tokenizer.decode(token_ids[:n]).endswith("\ufffd")]
    assert cuts, "the text has no character split across tokens"
    for cut in cuts:
        detok = IncrementalDetokenizer(tokenizer.decode)
        deltas = [detok.add(token_ids[:cut]).text] + [detok.add([t]).text for t in token_ids[cut:]]
        deltas.append(detok.add([], final=True).text)
        assert "".join(deltas) == tokenizer.decode(token_ids)
        assert not any(delta.endswith("\ufffd") for delta in deltas), (cut, deltas)
