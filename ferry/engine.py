"""The engine in one process: the scheduler's loop driving a worker. The services wrap exactly these parts."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

from base.config import EngineConfig, init_request, lora_module
from base.prompt_checks import check_token_ids
from base.sampling_params import SamplingParams
from protos import common_pb2, scheduler_pb2, worker_pb2
from protos.common_pb2 import TokenLogprob
from scheduler.baselines import scheduler_for
from scheduler.core import RequestOutput
from scheduler.sequence import DEFAULT_TENANCY, Tenancy


@dataclass
class SampleResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleResult]
    prompt_logprobs: list[TokenLogprob] | None = None   # when asked: one per prompt token after the first
    embedding: list[float] | None = None                # when asked: the prompt's (return_embedding)

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.samples[0].finish_reason


class StepWorker(Protocol):
    """gpu_worker.worker.Worker in process, or a client of one behind gRPC."""

    def init(self, req: worker_pb2.InitRequest) -> worker_pb2.InitResponse: ...

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResult: ...

    def load_adapter(self, req: common_pb2.LoraAdapterRequest) -> worker_pb2.LoadAdapterResponse: ...


class Engine:
    def __init__(self, config: EngineConfig | None = None, worker: StepWorker | None = None):
        self.config = config or EngineConfig()
        self.config.validate()
        if worker is None:
            from gpu_worker.worker import Worker
            worker = Worker()
        self.worker = worker
        self.started = worker.init(init_request(self.config))   # device_info, rank_weight_bytes
        self.info = self.started.model
        self.scheduler = scheduler_for(self.config, self.info)
        self._tokenizer = None
        self.ids = itertools.count()
        self.last_step_seconds = self.last_idle_seconds = 0.0
        for module in self.config.lora_modules:
            self.load_lora_adapter(*lora_module(module))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.info.model_path)
        return self._tokenizer

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False).input_ids if prompt else []
        check_token_ids(prompt, self.info.vocab_size)
        return list(prompt)

    def load_lora_adapter(self, name: str, path: str) -> worker_pb2.LoadAdapterResponse:
        """Load a PEFT adapter that requests may then name; ValueError saying why it does not fit."""
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need enable_lora")
        response = self.worker.load_adapter(common_pb2.LoraAdapterRequest(name=name, path=path))
        self.scheduler.lora.loaded[name] = path
        return response

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    tenancy: Tenancy = DEFAULT_TENANCY, lora_name: str = "") -> list[int]:
        """tenancy: the request's tenant and priority, for --scheduling-policy; lora_name: a loaded adapter."""
        token_ids = self.encode(prompt)
        self.scheduler.add_request(request_id, token_ids, params, tenancy=tenancy, lora_name=lora_name)
        return token_ids

    def step(self) -> list[RequestOutput]:
        """One step, start to end. In one process the worker would share the interpreter's lock with the scheduler,
        so steps run one at a time here; the scheduler service schedules ahead (async scheduling), its worker having
        a process of its own."""
        step = self.scheduler.schedule()
        if step is None:
            if self.scheduler.compiling or self.scheduler.structured.rows:
                time.sleep(0.001)   # a thread compiles a grammar or fills a mask: leave it the CPU
            return []
        result = self.worker.step(step)
        self.last_step_seconds, self.last_idle_seconds = result.forward_seconds, result.idle_seconds
        outputs = self.scheduler.update(step, result)
        self.scheduler.drain_kv_events()   # no prefix index to publish them to; undrained, they would pile up
        return outputs

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> scheduler_pb2.StatsResponse:
        return self.scheduler.stats()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 lora_names: list[str] | None = None) -> list[GenerationResult]:
        """lora_names: each prompt's adapter ("": the base model); None: the base model for all."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        lora_names = [""] * len(prompts) if lora_names is None else lora_names
        if len(params_list) != len(prompts) or len(lora_names) != len(prompts):
            raise ValueError(f"params, lora_names: got {len(params_list)}, {len(lora_names)} for {len(prompts)} "
                             "prompts")
        results: dict[str, GenerationResult] = {}
        params_of: dict[str, SamplingParams] = {}
        try:
            for prompt, p, lora_name in zip(prompts, params_list, lora_names):
                request_id = f"gen-{next(self.ids)}"
                token_ids = self.add_request(request_id, prompt, p, lora_name=lora_name)
                results[request_id] = GenerationResult(request_id, token_ids, [SampleResult() for _ in range(p.n)])
                params_of[request_id] = p
        except (ValueError, LookupError):
            for request_id in results:   # all or nothing: a bad prompt leaves no half-submitted batch behind
                self.abort(request_id)
            raise
        while self.has_unfinished_requests():
            for out in self.step():
                if out.request_id in results:
                    sample = results[out.request_id].samples[out.index]
                    sample.token_ids.extend(out.new_token_ids)
                    sample.finish_reason = out.finish_reason or sample.finish_reason
                    if out.prompt_logprobs is not None:
                        results[out.request_id].prompt_logprobs = out.prompt_logprobs
                    if out.embedding is not None:
                        results[out.request_id].embedding = out.embedding
        for request_id, result in results.items():
            for sample in result.samples:
                sample.text = self.sample_text(sample, params_of[request_id])
        return list(results.values())

    def sample_text(self, sample: SampleResult, params: SamplingParams) -> str:
        """As the router gives it: a stop token that ended the sample (an EOS, one of stop_token_ids) is counted
        but is not text, as in vLLM."""
        stopped = sample.finish_reason == "stop" and not params.include_stop_str_in_output
        return self.tokenizer.decode(sample.token_ids[:-1] if stopped else sample.token_ids,
                                     skip_special_tokens=params.skip_special_tokens)

