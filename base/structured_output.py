"""The constraint a request puts on its output (a JSON schema, any JSON object, a regex, an EBNF grammar or a
choice of strings), as plain data checked for what can be checked without compiling it. The scheduler compiles
it (scheduler/grammar_masks.py); this module stays free of torch and xgrammar, for the router."""
from __future__ import annotations

import json
from dataclasses import dataclass

from protos import common_pb2

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    kind: str                         # one of KINDS
    spec: str = ""                    # the schema (JSON text), regex or grammar; "" for json_object
    choices: tuple[str, ...] = ()     # kind "choice"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with the reason; the grammar itself is checked when the scheduler compiles it."""
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} must be at most {MAX_SPEC_CHARS} characters long")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise ValueError(f"the {self.kind} must not be empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from e
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (or a boolean)")
        if self.kind == "choice" and not 1 <= len(self.choices) <= MAX_CHOICES:
            raise ValueError(f"choice needs 1 to {MAX_CHOICES} strings, got {len(self.choices)}")
        if self.kind == "choice" and any(not c for c in self.choices):
            raise ValueError("choice strings must not be empty")

    @classmethod
    def from_proto(cls, msg: common_pb2.StructuredOutput) -> StructuredOutput | None:
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "choice":
            return cls(kind, choices=tuple(msg.choice.choices))
        if kind == "json_object":
            return cls(kind)
        return cls(kind, spec=getattr(msg, kind))

    def to_proto(self) -> common_pb2.StructuredOutput:
        if self.kind == "choice":
            return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=list(self.choices)))
        if self.kind == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        return common_pb2.StructuredOutput(**{self.kind: self.spec})
