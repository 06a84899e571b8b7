"""OpenAI's response JSON: whole bodies and stream chunks of /v1/completions and /v1/chat/completions."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protos import common_pb2, router_pb2
from protos.finish_reasons import FINISH_REASON_NAMES
from router.http.reasoning import ReasoningFactory, ReasoningParser, split_whole
from router.http.served_models import ServedModel
from router.http.tool_calls import ToolPlan, delta_json, finish_reason, parse_whole
from router.http.tool_parsers import ParsedDelta, ToolParser


@dataclass
class Choice:
    index: int
    text: str = ""
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt: list[common_pb2.TokenLogprob] = field(default_factory=list)   # scored (sample 0 only, when asked)

    def add(self, response: router_pb2.GenerateResponse) -> None:
        self.text += response.text
        self.logprobs.extend(response.logprobs)
        if response.prompt_token_ids:
            self.prompt = scored_prompt(response)
        if response.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES.get(response.finish_reason)
            self.stop_reason = response.stop_reason or None


def scored_prompt(response: router_pb2.GenerateResponse) -> list[common_pb2.TokenLogprob]:
    """The prompt's tokens with their logprobs; the first token has none (its entry's logprob is not one)."""
    return [common_pb2.TokenLogprob(token_id=response.prompt_token_ids[0]), *response.prompt_logprobs]


@dataclass
class Collected:
    choices: list[Choice]
    usage: common_pb2.Usage | None = None


def usage_json(usage: common_pb2.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


@dataclass
class ResponseFormat:
    """Shapes one request's responses; subclasses know their API's JSON."""
    object_name: ClassVar[str]
    chunk_object: ClassVar[str]
    request_id: str
    model: ServedModel
    want_logprobs: bool
    include_usage: bool = False
    continuous_usage: bool = False   # usage on every chunk (each response carries the request's so far)
    tokens_as_ids: bool = False      # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"
    usage: common_pb2.Usage | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def token_name(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or its id where its text would not tell it apart."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.model.token_text(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.token_name(token_id).encode()) if self.tokens_as_ids else self.model.token_bytes(token_id)

    def envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model.alias_of or self.model.name, "choices": choices, **extra}

    def body(self, collected: Collected) -> dict[str, Any]:
        choices = [self.final_choice(c) for c in collected.choices]
        return self.envelope(self.object_name, choices, usage=usage_json(collected.usage))

    def chunk(self, response: router_pb2.GenerateResponse) -> dict[str, Any] | None:
        if response.HasField("usage"):
            self.usage = response.usage
        if not (response.text or response.logprobs or response.finish_reason or self.opens(response)):
            return None      # text held back (a possible stop string or half a character)
        choice = self.chunk_choice(response)
        if choice is None:
            return None
        if not self.include_usage:
            return self.envelope(self.chunk_object, [choice])
        # null but in the usage chunk at the end, unless usage on every chunk was asked for (continuous_usage_stats)
        return self.envelope(self.chunk_object, [choice],
                             usage=usage_json(response.usage) if self.continuous_usage else None)

    def usage_chunk(self) -> dict[str, Any]:
        return self.envelope(self.chunk_object, [], usage=usage_json(self.usage))

    def opening_chunks(self, num_samples: int) -> list[dict[str, Any]]:
        return []

    def opens(self, response: router_pb2.GenerateResponse) -> bool:
        """Whether this response's chunk carries something of the format's own even when the response is empty."""
        return False

    def final_choice(self, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, response: router_pb2.GenerateResponse) -> dict[str, Any] | None:
        """None: nothing to send for this response yet."""
        raise NotImplementedError


@dataclass
class CompletionFormat(ResponseFormat):
    object_name = chunk_object = "text_completion"
    text_offsets: dict[int, int] = field(default_factory=dict)
    echo: str | None = None               # the prompt text each choice starts with (echo: true)
    prompt_only: bool = False             # echo with max_tokens 0: the one token generated is dropped
    want_prompt_logprobs: bool = False    # vLLM's `prompt_logprobs` on each choice
    prompt: list[common_pb2.TokenLogprob] = field(default_factory=list)   # the scored prompt, once it came
    echoed: set[int] = field(default_factory=set)   # streamed choices whose prompt went out

    def logprobs_json(self, entries: list[common_pb2.TokenLogprob], offset: int = 0,
                      unscored_first: bool = False) -> dict[str, Any] | None:
        """OpenAI's shape; with `unscored_first` the first entry is the prompt's first token, which has no logprob."""
        if not self.want_logprobs:
            return None
        tokens = [self.token_name(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        token_logprobs: list[float | None] = [e.logprob for e in entries]
        top_logprobs: list[dict[str, float] | None] = [self.top_json(e) for e in entries]
        if unscored_first and entries:
            token_logprobs[0] = top_logprobs[0] = None
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def top_json(self, entry: common_pb2.TokenLogprob) -> dict[str, float]:
        return {self.token_name(t.token_id): t.logprob for t in entry.top}

    def prompt_logprobs_json(self) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's shape: None for the first token, then {token id: {logprob, decoded_token}} for each token and
        its top k."""
        def entry_json(e: common_pb2.TokenLogprob) -> dict[str, dict[str, Any]]:
            scored = {str(t.token_id): {"logprob": t.logprob, "decoded_token": self.model.token_text(t.token_id)}
                      for t in e.top}
            scored[str(e.token_id)] = {"logprob": e.logprob, "decoded_token": self.model.token_text(e.token_id)}
            return scored
        return [None, *(entry_json(e) for e in self.prompt[1:])]

    def shown(self, text: str, entries: list[common_pb2.TokenLogprob], opening: bool
              ) -> tuple[str, list[common_pb2.TokenLogprob]]:
        """A choice's text and logprob entries as the client sees them: without the generated token when only the
        prompt was asked for, after the prompt in the choice's opening with echo."""
        if self.prompt_only:
            text, entries = "", []
        if opening and self.echo is not None:
            text, entries = self.echo + text, self.prompt + entries
        return text, entries

    def body(self, collected: Collected) -> dict[str, Any]:
        self.prompt = next((c.prompt for c in collected.choices if c.prompt), [])
        return super().body(collected)

    def final_choice(self, choice: Choice) -> dict[str, Any]:
        text, entries = self.shown(choice.text, choice.logprobs, opening=True)
        extra = {"prompt_logprobs": self.prompt_logprobs_json()} if self.want_prompt_logprobs else {}
        return {"index": choice.index, "text": text,
                "logprobs": self.logprobs_json(entries, unscored_first=self.echo is not None),
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason, **extra}

    def chunk(self, response: router_pb2.GenerateResponse) -> dict[str, Any] | None:
        if response.prompt_token_ids:   # sample 0's first response: before any choice's opening
            self.prompt = scored_prompt(response)
        return super().chunk(response)

    def opens(self, response: router_pb2.GenerateResponse) -> bool:
        return self.echo is not None and response.index not in self.echoed

    def chunk_choice(self, response: router_pb2.GenerateResponse) -> dict[str, Any]:
        opening = self.opens(response)
        self.echoed.add(response.index)
        text, entries = self.shown(response.text, list(response.logprobs), opening)
        offset = self.text_offsets.get(response.index, 0)
        logprobs = self.logprobs_json(entries, offset, unscored_first=opening)
        if logprobs is not None and logprobs["tokens"]:
            self.text_offsets[response.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return {"index": response.index, "text": text, "logprobs": logprobs,
                "finish_reason": FINISH_REASON_NAMES.get(response.finish_reason),
                "stop_reason": response.stop_reason or None}


@dataclass
class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    tools: ToolPlan = field(default_factory=ToolPlan)
    reasoning: ReasoningFactory | None = None   # the router's --reasoning-parser; none: the text is all content
    include_reasoning: bool = True              # vLLM's: false leaves the reasoning out of the response
    parsers: dict[int, ToolParser] = field(default_factory=dict)   # by sample, while streaming
    reasoners: dict[int, ReasoningParser] = field(default_factory=dict)
    calling: set[int] = field(default_factory=set)                 # the samples that made a call

    def token_json(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.token_name(token_id), "logprob": logprob, "bytes": self.token_bytes(token_id)}

    def logprobs_json(self, entries: list[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {"content": [{**self.token_json(e.token_id, e.logprob),
                             "top_logprobs": [self.token_json(t.token_id, t.logprob) for t in e.top]}
                            for e in entries]}

    def final_choice(self, choice: Choice) -> dict[str, Any]:
        reasoning, text = split_whole(self.reasoning(), choice.text) if self.reasoning else ("", choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning:
            message["reasoning"] = (reasoning if self.include_reasoning else "") or None
            message["content"] = text if text or not reasoning else None
        finish = choice.finish_reason
        if self.tools.calls_tools:
            content, calls = parse_whole(self.tools.parser(), text)
            message["content"] = (content or None) if calls else content
            if calls:
                message["tool_calls"] = calls
            finish = finish_reason(finish, bool(calls))
        return {"index": choice.index, "message": message, "logprobs": self.logprobs_json(choice.logprobs),
                "finish_reason": finish, "stop_reason": choice.stop_reason}

    def chunk_choice(self, response: router_pb2.GenerateResponse) -> dict[str, Any] | None:
        finish = FINISH_REASON_NAMES.get(response.finish_reason)
        delta = self.parsed(response)
        if not (delta or response.logprobs or finish):
            return None      # the text so far may still open a tool call
        if delta.tool_calls:
            self.calling.add(response.index)
        return {"index": response.index, "delta": delta_json(delta),
                "logprobs": self.logprobs_json(list(response.logprobs)),
                "finish_reason": finish_reason(finish, response.index in self.calling),
                "stop_reason": response.stop_reason or None}

    def parsed(self, response: router_pb2.GenerateResponse) -> ParsedDelta:
        reasoning, text = self.split(response)
        delta = self.tool_parsed(response, text)
        delta.reasoning = reasoning if self.include_reasoning else ""
        return delta

    def split(self, response: router_pb2.GenerateResponse) -> tuple[str, str]:
        """The response's text as (reasoning, content)."""
        if self.reasoning is None:
            return "", response.text
        if response.index not in self.reasoners:
            self.reasoners[response.index] = self.reasoning()
        parser = self.reasoners[response.index]
        reasoning, content = parser.feed(response.text)
        if response.finish_reason:
            more_reasoning, more_content = parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def tool_parsed(self, response: router_pb2.GenerateResponse, text: str) -> ParsedDelta:
        if not self.tools.calls_tools:
            return ParsedDelta(text)
        if response.index not in self.parsers:
            self.parsers[response.index] = self.tools.parser()
        parser = self.parsers[response.index]
        delta = parser.feed(text)
        return delta.merge(parser.finish()) if response.finish_reason else delta

    def opening_chunks(self, num_samples: int) -> list[dict[str, Any]]:
        extra = {"usage": None} if self.include_usage else {}
        return [self.envelope(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}], **extra)
                for i in range(num_samples)]
