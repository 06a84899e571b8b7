"""The benchmark baselines Ferry is measured against, as small overrides of the core's hooks; scheduler_for()
is the one place that picks them from the config (batching="static", kv_layout="contiguous": fields the
benchmarks set on the in-process Engine; no service has a flag for them).

- Static batching: a batch (a cohort) is admitted only when nothing runs, and no request joins it mid-flight.
- Contiguous KV: every sequence reserves max_model_len tokens of blocks up front, and nothing is shared by prefix.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from base.config import EngineConfig
from protos import worker_pb2
from scheduler.block_manager import BlockManager
from scheduler.core import Scheduler
from scheduler.sequence import Sequence


class StaticBatchingScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cohort: set[str] = set()   # the requests of the batch in flight
        self.closed = False             # a batch is in flight: only its own (preempted) sequences come back

    def begin_admission(self) -> None:
        self.closed = bool(self.running)
        if not self.closed:
            self.cohort = set()
        super().begin_admission()

    def may_join(self, seq: Sequence) -> bool:
        """The whole cohort is admitted at once, past the step's token budget (its prefill chunks follow)."""
        return not self.closed or seq.request_id in self.cohort

    def joined(self, seq: Sequence) -> None:
        self.cohort.add(seq.request_id)


@dataclass
class ContiguousBlockManager(BlockManager):
    reserve_tokens: int = 0   # every sequence holds blocks for this many tokens from its admission on

    def __post_init__(self) -> None:
        self.enable_prefix_caching = False
        super().__post_init__()

    def blocks_for(self, num_tokens: int) -> int:
        return super().blocks_for(max(num_tokens, self.reserve_tokens))


def scheduler_for(config: EngineConfig, model: worker_pb2.ModelInfo) -> Scheduler:
    """The core Scheduler, or the baseline the config names."""
    scheduler_type = StaticBatchingScheduler if config.batching == "static" else Scheduler
    new_block_manager = (functools.partial(ContiguousBlockManager, reserve_tokens=model.max_model_len)
                         if config.kv_layout == "contiguous" else BlockManager)
    return scheduler_type(config, model, new_block_manager=new_block_manager)
