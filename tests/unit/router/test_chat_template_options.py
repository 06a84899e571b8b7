"""vLLM's chat request extensions: chat_template_kwargs, add_generation_prompt and continue_final_message render the
prompt transformers' apply_chat_template renders with the same arguments."""
from __future__ import annotations

import pytest

from protos import router_pb2
from router.chat_messages import chat_template_inputs
from router.http.schema import ChatCompletionRequest
from router.tokenizer import ChatTemplating, RouterTokenizer

# Qwen3's shape: thinking on unless the request's enable_thinking says otherwise, and the last message trimmed
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "Name a capital."}, {"role": "assistant", "content": "Paris is the capital of "}]


@pytest.fixture(scope="module")
def thinking_tokenizer_dir(tmp_path_factory):
    from tests.conftest import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("thinking-tokenizer")
    build_tiny_tokenizer(path, chat_template=THINKING_TEMPLATE)
    return path


def rendered(tokenizer_dir, messages: list[dict], **fields) -> str:
    chat = ChatCompletionRequest(messages=messages, **fields).chat()
    return RouterTokenizer(str(tokenizer_dir)).render_chat(*chat_template_inputs(chat))


def as_transformers(tokenizer_dir, messages: list[dict], **arguments) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(messages, tokenize=False, **arguments)


@pytest.mark.parametrize("fields, arguments", [
    ({}, {"add_generation_prompt": True}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"add_generation_prompt": True, "enable_thinking": False}),
    ({"chat_template_kwargs": {"enable_thinking": True}}, {"add_generation_prompt": True, "enable_thinking": True}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
])
def test_template_variables_and_the_generation_prompt_render_as_transformers(thinking_tokenizer_dir, fields,
                                                                             arguments):
    messages = CHAT[:1]
    prompt = rendered(thinking_tokenizer_dir, messages, **fields)
    assert prompt == as_transformers(thinking_tokenizer_dir, messages, **arguments)
    assert ("<think>" in prompt) == (fields.get("chat_template_kwargs") == {"enable_thinking": False})


@pytest.mark.parametrize("content", ["Paris is the capital of ", "Paris is", "Paris\n"])
def test_continue_final_message_ends_where_the_last_message_does_as_transformers(thinking_tokenizer_dir, content):
    """The template trims the message: the prompt ends at its text, trailing space dropped as transformers drops it."""
    messages = [CHAT[0], {"role": "assistant", "content": content}]
    prompt = rendered(thinking_tokenizer_dir, messages, continue_final_message=True, add_generation_prompt=False)
    assert prompt == as_transformers(thinking_tokenizer_dir, messages, continue_final_message=True)
    assert prompt.endswith(content.strip()) and "<|im_end|>" not in prompt.split("assistant\n")[-1]


def test_continue_final_message_with_a_template_that_keeps_spacing(tmp_path):
    from tests.conftest import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path)   # its template keeps each message's text as sent
    messages = [CHAT[0], {"role": "assistant", "content": "Paris is the capital of "}]
    prompt = rendered(tmp_path, messages, continue_final_message=True)
    assert prompt == as_transformers(tmp_path, messages, continue_final_message=True)
    assert prompt.endswith("capital of ")


@pytest.mark.parametrize("fields, message", [
    ({"chat_template_kwargs": {"messages": []}}, "messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": True}}, "add_generation_prompt"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
])
def test_a_request_that_sets_a_variable_twice_is_refused_naming_it(fields, message):
    field, why = ChatCompletionRequest(messages=CHAT, **fields).unsupported()
    assert message in why and field in ("chat_template_kwargs", "continue_final_message")


@pytest.mark.parametrize("template_kwargs, message", [("[1]", "a JSON object"), ("{", "not valid JSON"),
                                                      ('{"tools": []}', "tools")])
def test_template_kwargs_over_grpc_that_are_not_a_json_object_of_free_names_are_refused(template_kwargs, message):
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="hi")],
                                   template_kwargs=template_kwargs)
    with pytest.raises(ValueError, match=message):
        chat_template_inputs(chat)


def test_continue_final_message_without_a_last_message_to_continue_is_refused(thinking_tokenizer_dir):
    with pytest.raises(ValueError, match="continue_final_message"):
        RouterTokenizer(str(thinking_tokenizer_dir)).render_chat(*chat_template_inputs(
            router_pb2.ChatMessages(continue_final_message=True)))


@pytest.mark.parametrize("fields, thinks", [({}, False), ({"chat_template_kwargs": {"enable_thinking": True}}, True)])
def test_default_template_kwargs_hold_where_the_request_sets_none_and_the_request_wins(thinking_tokenizer_dir,
                                                                                      fields, thinks):
    """--default-chat-template-kwargs '{"enable_thinking": false}': thinking off unless the request turns it on."""
    tokenizer = RouterTokenizer(str(thinking_tokenizer_dir),
                                ChatTemplating(default_kwargs='{"enable_thinking": false}'))
    chat = ChatCompletionRequest(messages=CHAT[:1], **fields).chat()
    prompt = tokenizer.render_chat(*chat_template_inputs(chat))
    assert prompt == as_transformers(thinking_tokenizer_dir, CHAT[:1], add_generation_prompt=True,
                                     enable_thinking=thinks)
    assert ("<think>" in prompt) == (not thinks)


@pytest.mark.parametrize("value, message", [("[1]", "a JSON object"), ("{", "not valid JSON"),
                                            ('{"messages": []}', "messages")])
def test_default_template_kwargs_that_are_not_a_json_object_of_free_names_are_refused_naming_the_flag(value,
                                                                                                     message):
    with pytest.raises(ValueError, match=message) as refused:
        ChatTemplating.from_flags("", value)
    assert "--default-chat-template-kwargs" in str(refused.value)
