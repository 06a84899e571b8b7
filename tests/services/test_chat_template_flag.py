"""--chat-template (vLLM's flag): a chat template for a model that has none (or in place of its own), given as a
file or as the template's text; chats render with it as transformers renders them with the same template."""
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


@pytest.mark.parametrize("value, message", [("/no/such/template.jinja", "no file"),
                                            ("{% for m in messages %}", "does not compile")])
def test_a_chat_template_that_cannot_be_read_stops_the_router_naming_the_flag(value, message):
    done = subprocess.run([sys.executable, "-m", "router", "--chat-template", value, "--port", "0"],
                          capture_output=True, text=True, timeout=60, env=CHILD_ENV)
    assert done.returncode != 0
    assert "--chat-template" in done.stderr and message in done.stderr
