"""Tool calls read out of generated text as it streams, in the formats models are trained on (Hermes'
`<tool_call>{...}</tool_call>`, Llama 3's bare JSON: marked) and in the shapes a tool_choice grammar forces (a JSON
array of calls for "required", the arguments alone for a named function: forced).

A parser is fed the text deltas of one sample and answers each with a ParsedDelta: the content the user may see
now and the tool-call pieces OpenAI's stream sends (a call's first piece carries its id and name, later ones more
of its arguments' JSON text). Text that may still turn out to open a call is held back until it is known.
"""
from router.http.tool_parsers.deltas import ParsedDelta, ToolCallDelta
from router.http.tool_parsers.forced import CallArrayParser, NamedCallParser
from router.http.tool_parsers.marked import HermesParser, Llama3JsonParser
from router.http.tool_parsers.mistral import MistralParser
from router.http.tool_parsers.parser import ToolParser

__all__ = ["PARSERS", "CallArrayParser", "HermesParser", "Llama3JsonParser", "MistralParser", "NamedCallParser",
           "ParsedDelta", "ToolCallDelta", "ToolParser"]

PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
