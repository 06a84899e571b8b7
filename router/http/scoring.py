"""vLLM's /score and /rerank for an embedding model: a pair's score is the cosine similarity of the two texts'
embeddings (router/http/embeddings.py; they are L2-normalized, so their dot product)."""
from __future__ import annotations

import time
import uuid
from typing import Any

from router.http.embeddings import NONEMPTY_TEXT, TEXTS, Embedded, EmbeddingRequest, tokens_of
from router.http.schema import UINT32, RequestFields


class ScoringRequest(RequestFields):
    """What /score and /rerank share: how their texts are embedded."""
    add_special_tokens: bool = True

    def embedding_request(self, texts: list[str]) -> EmbeddingRequest:
        return EmbeddingRequest(input=texts, add_special_tokens=self.add_special_tokens, priority=self.priority,
                                cache_salt=self.cache_salt)


class ScoreRequest(ScoringRequest):
    """vLLM's body of POST /score: text_1 against each of text_2, or pair by pair when both are lists as long."""
    text_1: NONEMPTY_TEXT | TEXTS
    text_2: NONEMPTY_TEXT | TEXTS

    @property
    def firsts(self) -> list[str]:
        return [self.text_1] if isinstance(self.text_1, str) else self.text_1

    @property
    def seconds(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else self.text_2

    def unsupported(self) -> tuple[str, str] | None:
        if len(self.firsts) > 1 and len(self.firsts) != len(self.seconds):
            return "text_1", "text_1 must be one text, or as many as text_2 (scored pair by pair)"
        return None

    def pairs(self) -> list[tuple[int, int]]:
        """Each score's two texts, as indices into firsts + seconds."""
        n = len(self.firsts)
        return [(0 if n == 1 else j, n + j) for j in range(len(self.seconds))]


class RerankRequest(ScoringRequest):
    """vLLM's (Jina's, Cohere's) body of POST /rerank: the documents in order of their score against the query."""
    query: NONEMPTY_TEXT
    documents: TEXTS
    top_n: UINT32 = 0   # 0: all


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def score_body(request: ScoreRequest, embedded: Embedded, model: str) -> dict[str, Any]:
    data = [{"index": i, "object": "score", "score": cosine(embedded[a][0], embedded[b][0])}
            for i, (a, b) in enumerate(request.pairs())]
    tokens = tokens_of(embedded)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank_body(request: RerankRequest, embedded: Embedded, model: str) -> dict[str, Any]:
    """embedded: the query's, then each document's."""
    query = embedded[0][0]
    results = sorted(({"index": i, "document": {"text": text}, "relevance_score": cosine(query, embedded[1 + i][0])}
                      for i, text in enumerate(request.documents)), key=lambda r: -r["relevance_score"])
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results[:request.top_n or None],
            "usage": {"total_tokens": tokens_of(embedded)}}
