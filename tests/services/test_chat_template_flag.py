"""--chat-template (vLLM's flag): a chat template for a model that has none (or in place of its own), given as a
file or as the template's text; chats render with it as transformers renders them with the same template. And
--default-chat-template-kwargs, the template's variables where a request sets none."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.openai_fixtures import Reference
from tests.services_fixtures import CHILD_ENV, start_http_stack

# not the tiny model's own: a system line of its own, so the prompt shows which template ran
TEMPLATE = ("{{ 'You are Ferry.' }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def templateless_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with its chat template taken out, as base models ship."""
    path = tmp_path_factory.mktemp("templateless") / "tiny-base"
    shutil.copytree(tiny_llama_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("as_file", [True, False], ids=["file", "text"])
def test_a_model_without_a_template_chats_with_the_flags_template_as_transformers(templateless_dir, tmp_path,
                                                                                 as_file):
    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    reference = Reference(templateless_dir)
    prompt_ids = list(reference.tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE,
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"])
    want, _ = reference.greedy(prompt_ids, 6)
    flag = str(template_file) if as_file else TEMPLATE
    with start_http_stack(templateless_dir, router_flags=("--chat-template", flag)) as stack:
        chat = stack.client().chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=6,
                                                      temperature=0)
    assert chat.usage.prompt_tokens == len(prompt_ids)
    assert chat.choices[0].message.content == reference.decode(want)


def test_default_template_kwargs_render_chats_that_set_none_and_a_request_sets_its_own(templateless_dir):
    """--default-chat-template-kwargs (vLLM's flag): the template's variables for a request without
    chat_template_kwargs; a request's own override them."""
    template = "{{ system | default('') }}" + TEMPLATE.removeprefix("{{ 'You are Ferry.' }}")
    reference = Reference(templateless_dir)

    def prompt_ids(**variables) -> list[int]:
        return list(reference.tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=True,
                                                            add_generation_prompt=True, return_dict=True,
                                                            **variables)["input_ids"])
    by_default, own = prompt_ids(system="You are Ferry, a ferry."), prompt_ids(system="")
    assert len(by_default) > len(own)
    want, _ = reference.greedy(by_default, 6)
    flags = ("--chat-template", template, "--default-chat-template-kwargs", '{"system": "You are Ferry, a ferry."}')
    with start_http_stack(templateless_dir, router_flags=flags) as stack:
        client = stack.client()
        chat = client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=6, temperature=0)
        own_chat = client.chat.completions.create(model=stack.model, messages=MESSAGES, max_tokens=1,
                                                  extra_body={"chat_template_kwargs": {"system": ""}})
    assert chat.usage.prompt_tokens == len(by_default) and chat.choices[0].message.content == reference.decode(want)
    assert own_chat.usage.prompt_tokens == len(own)


@pytest.mark.parametrize("flag, value, message", [("--chat-template", "/no/such/template.jinja", "no file"),
                                                  ("--chat-template", "{% for m in messages %}", "does not compile"),
                                                  ("--default-chat-template-kwargs", "[1]", "a JSON object"),
                                                  ("--default-chat-template-kwargs", '{"tools": 1}', "tools")])
def test_a_chat_template_flag_that_cannot_be_read_stops_the_router_naming_the_flag(flag, value, message):
    done = subprocess.run([sys.executable, "-m", "router", flag, value, "--port", "0"],
                          capture_output=True, text=True, timeout=60, env=CHILD_ENV)
    assert done.returncode != 0
    assert flag in done.stderr and message in done.stderr
