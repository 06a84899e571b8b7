"""What the router tracks for one request while proxying its scheduler's stream: each sample's detokenizer, its
token count and whether it finished, cutting a response short where a stop string ended it.
"""
from __future__ import annotations

from dataclasses import dataclass

from protos import common_pb2, router_pb2, scheduler_pb2
from router.detokenizer import IncrementalDetokenizer


@dataclass
class SampleState:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    finished: bool = False


@dataclass
class StreamState:
    """What the router tracks for one request while proxying its scheduler's stream."""
    request_id: str
    num_prompt_tokens: int
    samples: list[SampleState]
    num_cached_tokens: int = 0
    stream_interval: int = 1   # tokens per response the client asked for
    scored_prompt: list[int] | None = None   # the prompt, when it asked for prompt logprobs: sent once with them
    num_finished: int = 0   # samples finished
    continuous_usage: bool = False   # usage on every response, not only the last

    @property
    def done(self) -> bool:
        return self.num_finished == len(self.samples)

    @property
    def resumable(self) -> bool:
        """Another scheduler can go on from the tokens received (router.core.resumed_request): one sample."""
        return len(self.samples) == 1 and not self.done

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=self.num_prompt_tokens,
                                completion_tokens=sum(s.num_tokens for s in self.samples),
                                cached_prompt_tokens=self.num_cached_tokens)

    def on_response(self, upstream: scheduler_pb2.ScheduleResponse) -> router_pb2.GenerateResponse | None:
        sample = self.samples[upstream.index]
        if sample.finished:   # already ended by a stop string
            return None
        # min: a resumed attempt's cache hits may reach into the tokens it resumed after
        self.num_cached_tokens = max(self.num_cached_tokens, min(upstream.num_cached_tokens, self.num_prompt_tokens))
        finish = upstream.finish_reason
        token_ids = upstream.token_ids[:]   # a list: slicing copies faster than list()
        # the scheduler's stops end on a stop token (an EOS, a stop token the request named, a grammar's last):
        # as in vLLM its text is not the answer's (an EOS's shows where special tokens are kept) but it counts
        unread = int(finish == common_pb2.FINISH_REASON_STOP and bool(token_ids)
                     and not sample.detokenizer.include_stop_str)
        delta, used = sample.detokenizer.add_until_stop(token_ids[:len(token_ids) - unread],
                                                        final=finish != common_pb2.FINISH_REASON_UNSPECIFIED)
        if delta.stop_string is None and used == len(token_ids) - unread:
            used = len(token_ids)
        sample.num_tokens += used
        # only the fields that are set: each one given to the constructor costs a copy
        response = router_pb2.GenerateResponse(request_id=self.request_id, token_ids=token_ids[:used], text=delta.text)
        if upstream.index:
            response.index = upstream.index
        if upstream.logprobs:
            response.logprobs.extend(upstream.logprobs[:used])
        if self.scored_prompt is not None and upstream.index == 0:   # sample 0's first message carries them
            response.prompt_token_ids.extend(self.scored_prompt)
            response.prompt_logprobs.extend(upstream.prompt_logprobs)
            self.scored_prompt = None
        if upstream.embedding:
            response.embedding.extend(upstream.embedding)
        if delta.stop_string is not None:
            finish, response.stop_reason = common_pb2.FINISH_REASON_STOP, delta.stop_string
        elif upstream.HasField("stop_token_id"):
            response.stop_reason = str(upstream.stop_token_id)
        if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
            response.finish_reason = finish
            sample.finished = True
            self.num_finished += 1
        if self.done or self.continuous_usage:
            response.usage.CopyFrom(self.usage())
        return response
