"""The OpenAI request fields that constrain or bias the output, mapped onto Ferry's SamplingParams: OpenAI's
`response_format` and `logit_bias`; vLLM's `structured_outputs` (and its older top-level `guided_*` names). At most
one constraint per request; what cannot be honoured is a 400 naming the field."""
from __future__ import annotations

import json
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from base.sampling_params import check_logit_bias
from base.structured_output import StructuredOutput
from protos import common_pb2
from router.http.errors import APIError

UINT32_MAX = 2**32 - 1
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema; `strict` or not, the schema is enforced."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = ""
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra field (its StructuredOutputsParams), the constraints Ferry serves."""
    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ConstrainedRequest(Protocol):
    response_format: ResponseFormat | None
    structured_outputs: StructuredOutputs | None
    guided_json: str | dict[str, Any] | None
    guided_regex: str | None
    guided_choice: list[str] | None
    guided_grammar: str | None
    logit_bias: dict[str, float] | None


def add_constraints(params: common_pb2.SamplingParams, request: ConstrainedRequest) -> None:
    """Set the request's structured output and logit_bias on params; APIError 400 when they are bad."""
    constraint = structured_output(request)
    if constraint is not None:
        params.structured_output.CopyFrom(constraint.to_proto())
    if request.logit_bias:
        params.logit_bias.update(token_id_bias(request.logit_bias))


def structured_output(request: ConstrainedRequest) -> StructuredOutput | None:
    named = requested_constraints(request)
    if len(named) > 1:
        names = ", ".join(param for param, _ in named)
        raise APIError(400, f"at most one structured output constraint per request, got {names}",
                       param=named[1][0])
    if not named:
        return None
    param, make = named[0]
    try:
        return make()
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param.split(".")[0]) from e


def requested_constraints(request: ConstrainedRequest) -> list[tuple[str, Any]]:
    """(param, a function building its StructuredOutput) for each constraint the request names."""
    named = []
    if request.response_format is not None and request.response_format.type != "text":
        named.append(("response_format", lambda: from_response_format(request.response_format)))
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        named += [(f"structured_outputs.{name}", constraint_builder(name, value)) for name, value in fields.items()
                  if not (name == "json_object" and value is False)]
    for field, name in GUIDED_FIELDS.items():
        value = getattr(request, field)
        if value is not None:
            named.append((field, constraint_builder(name, value)))
    return named


def constraint_builder(name: str, value: Any) -> Any:
    return lambda: vllm_constraint(name, value)


def vllm_constraint(name: str, value: Any) -> StructuredOutput:
    """One of vLLM's structured output fields (json, regex, choice, grammar, json_object) as Ferry's."""
    if name == "json":
        return json_schema_output(value)
    if name == "choice":
        return StructuredOutput("choice", choices=tuple(value))
    if name == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(name, spec=value)


def json_schema_output(schema: str | dict[str, Any] | bool) -> StructuredOutput:
    """A schema given as JSON text (vLLM accepts both) or as the object itself."""
    return StructuredOutput("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def from_response_format(response_format: ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    if response_format.json_schema is None or response_format.json_schema.json_schema is None:
        raise ValueError("type json_schema needs json_schema.schema, the JSON schema to follow")
    return json_schema_output(response_format.json_schema.json_schema)


def token_id_bias(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's keys are token ids as strings; the ids against the model's vocabulary are checked by the router."""
    biases = {}
    for key, bias in logit_bias.items():
        token_id = parsed_token_id(key)
        if token_id is None:
            shown = key if len(key) <= 32 else f"{key[:32]}..."
            raise APIError(400, f"logit_bias keys must be token ids (non-negative integers), got {shown!r}",
                           param="logit_bias")
        biases[token_id] = bias
    try:
        check_logit_bias(biases)
    except ValueError as e:
        raise APIError(400, str(e), param="logit_bias") from e
    return biases


def parsed_token_id(key: str) -> int | None:
    digits = key.strip()
    if not (digits.isascii() and digits.isdigit() and len(digits) <= len(str(UINT32_MAX))):
        return None   # int() of thousands of digits is slow, and past 4,300 a ValueError
    token_id = int(digits)
    return token_id if token_id <= UINT32_MAX else None
