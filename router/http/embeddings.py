"""OpenAI's /v1/embeddings: each input runs as a request of its own that computes its prompt and returns the
embedding with its one token (sampling.return_embedding: the last position's final hidden state, L2-normalized, as
vLLM's LAST pooling gives a decoder model's), answered together in the input's order. `dimensions` keeps the first
ones of each, normalized again, for a model trained so (Matryoshka representation learning: config.json's
`is_matryoshka` or `matryoshka_dimensions`, the keys vLLM reads); other models refuse it, as vLLM's do."""
from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy
from pydantic import Field

from protos import common_pb2, router_pb2
from router.http.errors import APIError, api_error
from router.http.schema import MAX_BATCH_PROMPTS, UINT32, RequestFields

NONEMPTY_TEXT = Annotated[str, Field(min_length=1)]
NONEMPTY_IDS = Annotated[list[UINT32], Field(min_length=1)]
TEXTS = Annotated[list[NONEMPTY_TEXT], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]


class EmbeddingRequest(RequestFields):
    input: NONEMPTY_TEXT | TEXTS | NONEMPTY_IDS | \
        Annotated[list[NONEMPTY_IDS], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: UINT32 | None = None
    add_special_tokens: bool = True         # vLLM's: the tokenizer's own (an EOS Qwen3-Embedding pools at, say)

    def unsupported(self) -> tuple[str, str] | None:
        if self.dimensions == 0:
            return "dimensions", "dimensions must be at least 1"
        return None

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """One prompt per embedding asked for (a list of ids is one prompt, as in OpenAI's API)."""
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)

    def generate_requests(self, request_id: str, model: str, prompts: list[list[int]]
                          ) -> list[router_pb2.GenerateRequest]:
        """One request per prompt (the inputs' token ids), each computing its prompt and one token."""
        sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)
        return [router_pb2.GenerateRequest(request_id=f"{request_id}-{i}", model=model, sampling=sampling,
                                           token_ids=router_pb2.TokenIds(ids=prompt), priority=self.priority or 0,
                                           cache_salt=self.cache_salt or "")
                for i, prompt in enumerate(prompts)]


@dataclass(frozen=True)
class Matryoshka:
    """What a model's config.json says of cutting its embeddings short."""
    trained: bool                        # is_matryoshka, or a list of sizes
    sizes: tuple[int, ...] = ()          # matryoshka_dimensions: the only sizes it takes (empty: any)
    hidden_size: int = 0                 # the whole embedding's (0: not said)

    def check(self, dimensions: int, model: str) -> None:
        """APIError 400 naming `dimensions` where the model may not be cut to that many."""
        if not self.trained:
            raise APIError(400, f'model "{model}" does not support matryoshka representation (its config.json '
                                "names no matryoshka_dimensions): changing output dimensions would give poor "
                                "embeddings", param="dimensions")
        if self.sizes and dimensions not in self.sizes:
            raise APIError(400, f'dimensions: model "{model}" only supports {list(self.sizes)} matryoshka '
                                "dimensions", param="dimensions")
        if self.hidden_size and dimensions > self.hidden_size:
            raise APIError(400, f"dimensions: at most the model's {self.hidden_size}", param="dimensions")


@lru_cache(maxsize=8)
def matryoshka_of(model_path: str) -> Matryoshka:
    config_file = Path(model_path) / "config.json"
    config = json.loads(config_file.read_text()) if model_path and config_file.is_file() else {}
    sizes = tuple(config.get("matryoshka_dimensions") or ())
    return Matryoshka(bool(sizes) or bool(config.get("is_matryoshka")), sizes, int(config.get("hidden_size", 0)))


def cut_short(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` numbers, L2-normalized again (the whole vector when None)."""
    if dimensions is None:
        return vector
    head = numpy.asarray(vector[:dimensions], dtype=numpy.float64)
    return (head / max(float(numpy.linalg.norm(head)), 1e-12)).tolist()


async def embedding_of(responses: AsyncIterator[router_pb2.GenerateResponse]) -> tuple[list[float], int]:
    """One request's embedding and its prompt's token count; APIError as the request failed."""
    embedding: list[float] = []
    prompt_tokens = 0
    async with contextlib.aclosing(responses):
        try:
            async for response in responses:
                embedding = embedding or list(response.embedding)
                if response.HasField("usage"):
                    prompt_tokens = response.usage.prompt_tokens
        except Exception as e:
            raise api_error(e) from e
    if not embedding:
        raise APIError(500, "the scheduler sent no embedding")
    return embedding, prompt_tokens


Embedded = list[tuple[list[float], int]]   # each text's embedding and its token count, in order


def tokens_of(embedded: Embedded) -> int:
    return sum(tokens for _, tokens in embedded)


def embeddings_body(results: Embedded, model: str, request: EmbeddingRequest) -> dict[str, Any]:
    prompt_tokens = tokens_of(results)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encoded(cut_short(vector, request.dimensions), request.encoding_format)}
                     for i, (vector, _) in enumerate(results)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the numbers; base64: their little-endian float32 bytes (what OpenAI's clients ask for by default)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(numpy.asarray(vector, dtype="<f4").tobytes()).decode()
