"""The reasoning parsers (--reasoning-parser): thinking and content split as vLLM's deepseek_r1 and qwen3 split them,
the same whatever pieces the text streams in, and shaped into chat messages and stream deltas."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import router_pb2
from router.http.formats import ChatFormat, Choice, Collected
from router.http.reasoning import REASONING_PARSERS, split_whole
from router.http.tool_calls import ToolPlan
from router.http.tool_parsers import HermesParser
from tests.unit.router.test_tool_parsers import MODEL

CASES = [   # text, deepseek_r1's (reasoning, content), qwen3's
    ("<think>\nParis is in France.\n</think>\n\nParis.", ("\nParis is in France.\n", "\n\nParis."),
     ("\nParis is in France.\n", "\n\nParis.")),
    ("Paris is in France.\n</think>\n\nParis.", ("Paris is in France.\n", "\n\nParis."),
     ("", "Paris is in France.\n</think>\n\nParis.")),
    ("Paris.", ("Paris.", ""), ("", "Paris.")),
    ("<think>still thinking", ("still thinking", ""), ("still thinking", "")),
    ("\n<think>a</think>b", ("a", "b"), ("a", "b")),
    ("<thin", ("<thin", ""), ("", "<thin")),
    ("a <think>b</think>c", ("a <think>b", "c"), ("", "a <think>b</think>c")),
    ("", ("", ""), ("", "")),
]


@pytest.mark.parametrize("text, deepseek_r1, qwen3", CASES)
def test_the_whole_text_splits_as_each_model_family_writes_it(text, deepseek_r1, qwen3):
    assert split_whole(REASONING_PARSERS["deepseek_r1"](), text) == deepseek_r1
    assert split_whole(REASONING_PARSERS["qwen3"](), text) == qwen3


def streamed(name: str, text: str, cuts: list[int]) -> tuple[str, str]:
    parser = REASONING_PARSERS[name]()
    reasoning = content = ""
    bounds = [0, *sorted(set(c % (len(text) + 1) for c in cuts)), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        more_reasoning, more_content = parser.feed(text[start:end])
        reasoning, content = reasoning + more_reasoning, content + more_content
    more_reasoning, more_content = parser.finish()
    return reasoning + more_reasoning, content + more_content


@settings(max_examples=300, deadline=None)
@given(text=st.sampled_from([case[0] for case in CASES]) | st.text(st.sampled_from("<>/thinkab \n"), max_size=30),
       cuts=st.lists(st.integers(0, 60), max_size=12), name=st.sampled_from(sorted(REASONING_PARSERS)))
def test_any_cut_of_the_stream_splits_as_the_whole_text(text, cuts, name):
    assert streamed(name, text, cuts) == split_whole(REASONING_PARSERS[name](), text)


def test_a_half_tag_is_held_until_it_is_known():
    parser = REASONING_PARSERS["deepseek_r1"]()
    assert parser.feed("<think>Paris</th") == ("Paris", "")
    assert parser.feed("ink>Yes") == ("", "Yes")
    qwen3 = REASONING_PARSERS["qwen3"]()
    assert qwen3.feed("<th") == ("", "") and qwen3.feed("e answer") == ("", "<the answer")


THOUGHT = "<think>The user wants the weather.</think>"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def chat_format(**fields) -> ChatFormat:
    return ChatFormat("chatcmpl-1", MODEL, False, reasoning=REASONING_PARSERS["deepseek_r1"], **fields)


def test_the_message_carries_the_reasoning_and_the_content_and_include_reasoning_false_leaves_it_out():
    body = chat_format().body(Collected([Choice(0, THOUGHT + "It is sunny.", finish_reason="stop")]))
    assert body["choices"][0]["message"] == {"role": "assistant", "reasoning": "The user wants the weather.",
                                             "content": "It is sunny."}
    unthinking = chat_format(include_reasoning=False).body(Collected([Choice(0, THOUGHT + "It is sunny.")]))
    assert unthinking["choices"][0]["message"] == {"role": "assistant", "reasoning": None, "content": "It is sunny."}
    cut_short = chat_format().body(Collected([Choice(0, "<think>The user", finish_reason="length")]))
    assert cut_short["choices"][0]["message"]["content"] is None


def test_tool_calls_are_read_from_the_content_after_the_thinking():
    fmt = chat_format(tools=ToolPlan(parser=HermesParser))
    choice = fmt.body(Collected([Choice(0, THOUGHT + CALL, finish_reason="stop")]))["choices"][0]
    assert choice["message"]["reasoning"] == "The user wants the weather."
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("size", [1, 3, 7])
def test_stream_deltas_add_up_to_the_message(size):
    text = THOUGHT + "It is sunny." + CALL
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    fmt = chat_format(tools=ToolPlan(parser=HermesParser))
    deltas = []
    for i, piece in enumerate(pieces):
        finish = 2 if i == len(pieces) - 1 else 0
        chunk = fmt.chunk(router_pb2.GenerateResponse(index=0, text=piece, finish_reason=finish))
        deltas += [chunk["choices"][0]["delta"]] if chunk else []
    whole = chat_format(tools=ToolPlan(parser=HermesParser)).body(Collected([Choice(0, text, finish_reason="stop")]))
    message = whole["choices"][0]["message"]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    assert arguments == message["tool_calls"][0]["function"]["arguments"]
