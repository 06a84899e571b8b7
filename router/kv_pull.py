"""The router's third choice (issue 42): send a request to a less loaded scheduler that pulls the prompt's cached
blocks from the scheduler holding them (ScheduleRequest.kv_source), instead of queueing at the holder or recomputing
the prefix elsewhere. The receiver falls back to recomputing on any failure, so a pull that does not happen costs
what (c) costs.

What a pull costs is put in the unit the cache-aware policy weighs everything in, prefill tokens: pulling a block
costs `kv_pull_cost` of recomputing it. The default, 0.1, is a CPU pull over loopback measured against recomputing
the same blocks (a 16-token block of SmolLM2 in bf16 is ~360 KB; a 2k-token prefix takes seconds of CPU to
recompute and tens of milliseconds to move); on GPUs with NVLink or RDMA between them the ratio is smaller
(llm-d: a 48k-token prefix pulled in 235 ms against 1,988 ms to recompute it: ~0.12)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from base.options import option
from protos import scheduler_pb2
from protos.registration import SchedulerInfo


@dataclass(frozen=True)
class KvPullOptions:
    kv_pull: bool = option(True, "the cache-aware router may send a request to a less loaded scheduler that pulls "
                                 "the prompt's cached blocks from the scheduler holding them",
                           switch_off="--no-kv-pull")
    kv_pull_cost: float = option(0.1, "pulling one cached block from its holder, as a fraction of recomputing it "
                                      "(transfer time over prefill time; ~0.1 on a CPU over loopback)")
    kv_pull_min_blocks: int = option(2, "fewest blocks a pull must bring (the holder's match less the receiver's) "
                                        "for the router to choose it")

    def __post_init__(self) -> None:
        if self.kv_pull_cost < 0 or self.kv_pull_min_blocks < 1:
            raise ValueError("--kv-pull-cost must not be negative and --kv-pull-min-blocks must be at least 1")


@dataclass(frozen=True)
class KvPull:
    """Where a scheduler pulls the prompt's leading blocks from: the holder, and how many it holds (the prefix
    index's count, never the router's guess: only published blocks can be read)."""
    holder: SchedulerInfo
    num_blocks: int

    def kv_source(self) -> scheduler_pb2.KvSource:
        return scheduler_pb2.KvSource(scheduler_id=self.holder.scheduler_id, address=self.holder.address,
                                      num_blocks=self.num_blocks)


def deepest_holder(candidates: Sequence[SchedulerInfo], indexed: dict[str, int]) -> KvPull | None:
    """The live scheduler the prefix index says holds the most leading prompt blocks (ties: the lowest id)."""
    holders = [(-indexed[c.scheduler_id], c.scheduler_id, c) for c in candidates if indexed.get(c.scheduler_id)]
    if not holders:
        return None
    blocks, _, holder = min(holders)
    return KvPull(holder, -blocks)


def pull_worth_it(pull: KvPull | None, info: SchedulerInfo, local_blocks: int, options: KvPullOptions) -> bool:
    """Whether `info` may pull from the holder: pulling is on, it is not the holder, and the pull brings enough."""
    return (options.kv_pull and pull is not None and pull.holder.scheduler_id != info.scheduler_id
            and pull.num_blocks - local_blocks >= options.kv_pull_min_blocks)


def pull_tokens(pull: KvPull, info: SchedulerInfo, local_blocks: int, options: KvPullOptions) -> float:
    """The pull's own cost, in prefill tokens: the blocks it brings at `kv_pull_cost` of recomputing each."""
    return options.kv_pull_cost * (pull.num_blocks - local_blocks) * (info.block_size or 16)
