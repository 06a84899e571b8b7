"""Sampling parameters: one resolved, validated form shared by router, scheduler and worker."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


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

    def __post_init__(self) -> None:
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
    def from_proto(cls, msg: common_pb2.SamplingParams) -> SamplingParams:
        """Resolve unset optional fields to their defaults; raises ValueError on bad values."""
        kwargs: dict = {
            "stop": tuple(msg.stop),
            "stop_token_ids": tuple(msg.stop_token_ids),
            "ignore_eos": msg.ignore_eos,
            "include_stop_str_in_output": msg.include_stop_str_in_output,
            "structured_output": StructuredOutput.from_proto(msg.structured_output),
            "logit_bias": dict(msg.logit_bias),
            "bad_words": tuple(msg.bad_words),
        }
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "n",
                     "min_tokens", "prompt_logprobs"):
            if msg.HasField(name):
                kwargs[name] = getattr(msg, name)
        return cls(**kwargs)

    def to_proto(self) -> common_pb2.SamplingParams:
        msg = common_pb2.SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, n=self.n,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self.logit_bias,
            bad_words=list(self.bad_words),
        )
        if self.structured_output is not None:
            msg.structured_output.CopyFrom(self.structured_output.to_proto())
        if self.min_tokens:
            msg.min_tokens = self.min_tokens
        if self.seed is not None:
            msg.seed = self.seed
        if self.logprobs is not None:
            msg.logprobs = self.logprobs
        if self.prompt_logprobs is not None:
            msg.prompt_logprobs = self.prompt_logprobs
        return msg


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
