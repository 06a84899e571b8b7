"""The bodies of vLLM's /tokenize and /detokenize (router/http/app.py serves them)."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from protos import router_pb2
from router.http.schema import ChatMessageIn, ChatTemplateFields, ToolDefinition


class TokenizeRequest(ChatTemplateFields):
    """vLLM's body of POST /tokenize: a prompt, or chat messages (and tools) as the chat template renders them."""
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool = False   # False: the ids /v1/completions runs; True: the tokenizer's BOS and the like
    return_token_strs: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        if (self.prompt is None) == (self.messages is None):
            return "prompt", "give either prompt or messages"
        if self.messages is not None and self.add_special_tokens:
            return "add_special_tokens", "not with messages: the chat template places the special tokens"
        return self.template_unsupported()

    def chat(self) -> router_pb2.ChatMessages:
        return self.chat_proto(self.messages or [], self.tools)


class DetokenizeRequest(BaseModel):
    """vLLM's body of POST /detokenize."""
    model: str = ""
    tokens: list[Annotated[int, Field(ge=0)]]
