"""The router's tokenizer: the model's tokenizer.json and chat template, without transformers (hence no torch).

Encoding and decoding match transformers' fast tokenizer as the engine uses it (no special tokens added on
encode, special tokens skipped on decode); chat prompts are rendered with the model's Jinja chat template the way
transformers' apply_chat_template does.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from router.chat_messages import TemplateOptions, template_variables
from router.prompt_length import LONG_PROMPT_CHARS


class ChatTemplateError(ValueError):
    pass


def raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def special_token_text(value) -> str:
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


@dataclass(frozen=True)
class ChatTemplating:
    """How the router renders every model's chats (vLLM's flags): --chat-template, in place of each model's own,
    and --default-chat-template-kwargs, the template variables of a request that does not set them."""
    template: str | None = None
    default_kwargs: str = ""   # a JSON object's text: hashable, as tokenizers are cached by it

    @staticmethod
    def from_flags(chat_template: str, default_kwargs: str) -> ChatTemplating:
        """ValueError naming the flag that cannot be read."""
        template_variables(default_kwargs, "--default-chat-template-kwargs")
        return ChatTemplating(read_chat_template(chat_template), default_kwargs)


class RouterTokenizer:
    def __init__(self, model_path: str, templating: ChatTemplating = ChatTemplating()):
        path = Path(model_path)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.chat_template = templating.template or self.load_chat_template(path)
        self.default_template_variables = template_variables(templating.default_kwargs,
                                                             "--default-chat-template-kwargs")

    def load_chat_template(self, path: Path) -> str | None:
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = self.config.get("chat_template")
        if isinstance(template, list):   # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: the tokenizer's own (a BOS, say), which a prompt Ferry runs never gets."""
        if len(text) > LONG_PROMPT_CHARS:   # encode_batch frees the GIL while it works (encode holds it)
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids if text else []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def compiled_chat_template(self) -> jinja2.Template:
        """The chat template compiled once, on first use: rendering it is all a request pays."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        return env.from_string(self.chat_template)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    options: TemplateOptions = TemplateOptions()) -> str:
        """The prompt for OpenAI-shaped messages (tool calls' arguments as dicts), the tools when given, and the
        template's further variables; with continue_final_message it ends where the last message's text does."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: send a text prompt")
        if options.continue_final_message:
            messages = tagged_final_message(messages)
        try:
            rendered = self.compiled_chat_template.render(
                **{**self.default_template_variables, **options.variables}, messages=messages, tools=tools,
                add_generation_prompt=options.add_generation_prompt,
                bos_token=special_token_text(self.config.get("bos_token")),
                eos_token=special_token_text(self.config.get("eos_token")))
        except (jinja2.TemplateError, TypeError) as e:   # TypeError: a template that cannot take these messages
            raise ValueError(f"chat template failed: {e}") from e
        return cut_at_final_message(rendered) if options.continue_final_message else rendered

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    options: TemplateOptions = TemplateOptions()) -> list[int]:
        return self.encode(self.render_chat(messages, tools, options))


# transformers' way to find where the last message's text ends in the rendered prompt: a tag after it, cut off
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tagged_final_message(messages: list[dict]) -> list[dict]:
    if not messages or not isinstance(messages[-1].get("content"), str):
        raise ValueError("continue_final_message needs a last message with text to continue")
    last = messages[-1]
    return [*messages[:-1], {**last, "content": last["content"] + CONTINUE_TAG}]


def cut_at_final_message(rendered: str) -> str:
    at = rendered.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not show the last message's text")
    if rendered.startswith(CONTINUE_TAG, at):
        return rendered[:at]
    return rendered[:at].rstrip()   # the template trimmed the text's trailing space, and the tag's with it


_loading = threading.Lock()


def load_tokenizer(model_path: str, templating: ChatTemplating = ChatTemplating()) -> RouterTokenizer:
    """One tokenizer per model path; a burst of first requests loads it once, not once per request."""
    with _loading:
        return cached_tokenizer(model_path, templating)


@lru_cache(maxsize=8)
def cached_tokenizer(model_path: str, templating: ChatTemplating) -> RouterTokenizer:
    return RouterTokenizer(model_path, templating)


def read_chat_template(value: str) -> str | None:
    """vLLM's --chat-template: a file's path, or the template's text itself; None when not given. Raises
    ValueError for a path that names no file or a template that does not compile."""
    if not value:
        return None
    path = Path(value)
    if path.suffix in (".jinja", ".j2", ".txt") or "{" not in value:
        if not path.is_file():
            raise ValueError(f"--chat-template: no file {value}")
        value = path.read_text()
    try:
        ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not compile: {e}") from e
    return value
