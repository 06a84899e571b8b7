"""Sampling parameters: one resolved, validated form shared by router, scheduler and worker.

The dataclass below is the one declaration of the sampling fields: their names, types and defaults. The wire's
message (protos/common.proto's SamplingParams) carries the same fields, one for one, and the conversion both ways
(from_proto, to_proto), the HTTP APIs' fields (router/http/schema.py) and the finite-number check are derived from
it. Adding a field is a line here, its line in the message, its check in validate() and the code that honours it.
"""
from __future__ import annotations

import math
from collections.abc import MutableMapping, MutableSequence
from dataclasses import InitVar, dataclass, field, fields
from typing import get_args, get_type_hints

from google.protobuf.message import Message

from base.structured_output import StructuredOutput
from protos import common_pb2

MAX_TOP_LOGPROBS = 20
MAX_SAMPLES = 16             # n: parallel samples of one request
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # a stop string is held back from the stream while it may still be starting
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0   # OpenAI's bound
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)   # token id -> added to its logit
    min_tokens: int = 0                 # EOS and stop_token_ids are masked until this many tokens are out
    bad_words: tuple[str, ...] = ()     # no token sequence spelling one of these is sampled (vLLM's bad_words)
    prompt_logprobs: int | None = None  # k: each prompt token's logprob and the top k (the first token has none)
    trusted: InitVar[bool] = False      # its values were validated where the request arrived: not checked again

    def __post_init__(self, trusted: bool) -> None:
        if not trusted:
            self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        for name in FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        self.validate_stops()
        self.validate_logit_bias()
        self.validate_bad_words()
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    def validate_logit_bias(self) -> None:
        check_logit_bias(self.logit_bias)

    def validate_bad_words(self) -> None:
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad_words are allowed, got {len(self.bad_words)}")
        if any(not word.strip() for word in self.bad_words):
            raise ValueError("bad_words must not be empty or blank")
        if any(len(word) > MAX_BAD_WORD_CHARS for word in self.bad_words):
            raise ValueError(f"bad_words must be at most {MAX_BAD_WORD_CHARS} characters long")

    def validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams, trusted: bool = False) -> SamplingParams:
        """Resolve unset optional fields to their defaults; raises ValueError on bad values unless `trusted` (a
        worker's, whose scheduler checked them)."""
        kwargs: dict = {}
        for name, kind in WIRE_KINDS.items():
            if kind == "optional":
                if msg.HasField(name):
                    kwargs[name] = getattr(msg, name)
            elif kind == "repeated":
                kwargs[name] = tuple(getattr(msg, name))
            elif kind == "map":
                kwargs[name] = dict(getattr(msg, name))
            elif kind == "message":
                kwargs[name] = MESSAGE_TYPES[name].from_proto(getattr(msg, name))
            else:
                kwargs[name] = getattr(msg, name)
        return cls(**kwargs, trusted=trusted)

    def to_proto(self) -> common_pb2.SamplingParams:
        msg = common_pb2.SamplingParams()
        for name, kind in WIRE_KINDS.items():
            value = getattr(self, name)
            if kind == "repeated":
                getattr(msg, name).extend(value)
            elif kind == "map":
                getattr(msg, name).update(value)
            elif value is None:
                continue
            elif kind == "message":
                getattr(msg, name).CopyFrom(value.to_proto())
            else:
                setattr(msg, name, value)
        return msg


def wire_kind(name: str) -> str:
    """How the message holds a field: optional (unset: the dataclass's default), plain, repeated, map or message."""
    if name not in common_pb2.SamplingParams.DESCRIPTOR.fields_by_name:
        raise TypeError(f"SamplingParams.{name} has no field in protos/common.proto's SamplingParams")
    value = getattr(common_pb2.SamplingParams(), name)
    if isinstance(value, MutableMapping):
        return "map"
    if isinstance(value, MutableSequence):
        return "repeated"
    if isinstance(value, Message):
        return "message"
    return "optional" if common_pb2.SamplingParams.DESCRIPTOR.fields_by_name[name].has_presence else "plain"


def message_class(name: str) -> type:
    """A message field's dataclass, which converts itself (from_proto, to_proto): its annotation's class."""
    return next(t for t in get_args(get_type_hints(SamplingParams)[name]) if t is not type(None))


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
WIRE_KINDS = {name: wire_kind(name) for name in SAMPLING_FIELDS}
MESSAGE_TYPES = {name: message_class(name) for name, kind in WIRE_KINDS.items() if kind == "message"}
FLOAT_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.type == "float")


def check_logit_bias(logit_bias: dict[int, float]) -> None:
    """Raise ValueError naming logit_bias if it names too many tokens, a negative id, or a bias out of range."""
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(logit_bias)}")
    for token_id, bias in logit_bias.items():
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} "
                             f"for token {token_id}")
