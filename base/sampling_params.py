"""Sampling parameters: one resolved, validated form shared by router, scheduler and worker.

The one declaration of the sampling fields is the wire's message, protos/common.proto's SamplingParams: each field's
name and type, the value an unset field means and the range it accepts (the options of protos/field_rules.proto).
The dataclass SamplingParams is made from it, and so are the conversion both ways (from_proto, to_proto), the HTTP
APIs' fields (router/http/schema.py) and the range and finite-number checks. Adding a field is its line in the
message and the code that honours it (with a check in validate() where a range cannot say what it accepts).
"""
from __future__ import annotations

import json
import math
from dataclasses import InitVar, dataclass, field, fields, make_dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from base.structured_output import StructuredOutput
from protos import common_pb2, field_rules_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # a stop string is held back from the stream while it may still be starting
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0   # OpenAI's bound
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 18   # more than any vocabulary
MAX_BAD_WORD_CHARS = 256
MAX_THINKING_END_TOKENS = 16   # structured_output_after: a marker such as </think>, a token or a few

WIRE = common_pb2.SamplingParams.DESCRIPTOR
SCALAR_TYPES = {FieldDescriptor.TYPE_UINT32: int, FieldDescriptor.TYPE_INT32: int, FieldDescriptor.TYPE_UINT64: int,
                FieldDescriptor.TYPE_INT64: int, FieldDescriptor.TYPE_FLOAT: float,
                FieldDescriptor.TYPE_DOUBLE: float, FieldDescriptor.TYPE_BOOL: bool, FieldDescriptor.TYPE_STRING: str}
MESSAGE_CLASSES = {"ferry.StructuredOutput": StructuredOutput}   # message fields: the dataclass that converts each


@dataclass(frozen=True)
class Range:
    """The values a field accepts, from its minimum, exclusive_minimum and maximum options."""
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None

    @classmethod
    def of(cls, wire_field: FieldDescriptor) -> Range:
        options = wire_field.GetOptions()
        bounds = {rule.name: options.Extensions[rule] for rule in RANGE_RULES if options.HasExtension(rule)}
        return cls(**bounds)

    def check(self, name: str, value: float | None) -> None:
        """Raise ValueError naming the field if a value (None: unset) lies outside."""
        if value is None:
            return
        low_ok = ((self.minimum is None or value >= self.minimum)
                  and (self.exclusive_minimum is None or value > self.exclusive_minimum))
        if not (low_ok and (self.maximum is None or value <= self.maximum)):
            raise ValueError(f"{name} must be {self.described()}, got {value}")

    def described(self) -> str:
        low = (f"[{self.minimum:g}" if self.minimum is not None
               else f"({self.exclusive_minimum:g}" if self.exclusive_minimum is not None else None)
        if low is not None and self.maximum is not None:
            return f"in {low}, {self.maximum:g}]"
        if low is not None:
            return f"at least {self.minimum:g}" if self.minimum is not None else f"above {self.exclusive_minimum:g}"
        return f"at most {self.maximum:g}"


RANGE_RULES = (field_rules_pb2.minimum, field_rules_pb2.exclusive_minimum, field_rules_pb2.maximum)


class SamplingRules:
    """What SamplingParams does beyond holding its fields: its checks, and its conversion to and from the wire."""

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
        for name, accepted in RANGES.items():
            accepted.check(name, getattr(self, name))
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or at least 1, got {self.top_k}")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the context) or at least 1, got "
                             f"{self.truncate_prompt_tokens}")
        self.validate_stops()
        self.validate_logit_bias()
        self.validate_bad_words()
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"at most {MAX_ALLOWED_TOKEN_IDS} allowed_token_ids, got {len(self.allowed_token_ids)}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if len(self.structured_output_after) > MAX_THINKING_END_TOKENS:
            raise ValueError(f"structured_output_after must be at most {MAX_THINKING_END_TOKENS} token ids, got "
                             f"{len(self.structured_output_after)}")

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
                if msg.HasField(name):
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


def wire_kind(wire_field: FieldDescriptor) -> str:
    """How the message holds a field: optional (unset: its default), plain, repeated, map or message."""
    if wire_field.message_type is not None and wire_field.message_type.GetOptions().map_entry:
        return "map"
    if wire_field.is_repeated:
        return "repeated"
    if wire_field.message_type is not None:
        return "message"
    return "optional" if wire_field.has_presence else "plain"


def dataclass_field(wire_field: FieldDescriptor) -> tuple[str, Any, Any]:
    """A wire field as the dataclass holds it: its name, its Python type and its default."""
    name, kind = wire_field.name, wire_kind(wire_field)
    if kind == "map":
        key, value = (SCALAR_TYPES[entry.type] for entry in wire_field.message_type.fields)
        return name, dict[key, value], field(default_factory=dict, hash=False)
    if kind == "message":
        return name, MESSAGE_CLASSES[wire_field.message_type.full_name] | None, None
    scalar = SCALAR_TYPES[wire_field.type]
    if kind == "repeated":
        return name, tuple[scalar, ...], ()
    options = wire_field.GetOptions()
    if options.HasExtension(field_rules_pb2.default_value):
        return name, scalar, scalar(json.loads(options.Extensions[field_rules_pb2.default_value]))
    return (name, scalar | None, None) if kind == "optional" else (name, scalar, scalar())


def make_sampling_params() -> type:
    made = make_dataclass("SamplingParams", [*map(dataclass_field, WIRE.fields), ("trusted", InitVar[bool], False)],
                          bases=(SamplingRules,), frozen=True)
    made.__module__ = __name__
    made.__doc__ = ("The sampling fields of protos/common.proto's SamplingParams, resolved: unset ones hold their "
                    "declared defaults. `trusted`: its values were validated where the request arrived, not again.")
    return made


SamplingParams = make_sampling_params()
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
WIRE_KINDS = {f.name: wire_kind(f) for f in WIRE.fields}
MESSAGE_TYPES = {f.name: MESSAGE_CLASSES[f.message_type.full_name] for f in WIRE.fields
                 if WIRE_KINDS[f.name] == "message"}
FLOAT_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.type is float)
RANGES = {f.name: Range.of(f) for f in WIRE.fields if Range.of(f) != Range()}
MAX_SAMPLES = int(RANGES["n"].maximum)           # n: parallel samples of one request
MAX_TOP_LOGPROBS = int(RANGES["logprobs"].maximum)


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
