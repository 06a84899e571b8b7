"""Steps the worker runs before it says it is ready: on a GPU each Triton kernel variant a configuration can reach
compiles here (the prefill kernel's tiles follow the chunk's length, the decode kernel splits contexts longer than
a partition), not in a live request's step.

The steps write into the pool's first blocks, which hold nothing yet, and the worker forgets their sequences
after.
"""
from __future__ import annotations

from base.sampling_params import SamplingParams
from protos import common_pb2, worker_pb2

GREEDY = SamplingParams(temperature=0, max_tokens=1).to_proto()


def prefill_request(lengths: list[int], block_size: int, sampling: common_pb2.SamplingParams = GREEDY,
                    prefix: str = "warm-up") -> worker_pb2.StepRequest:
    """One step prefilling a prompt of each length, in blocks 0, 1, 2, ... of the pool."""
    request, next_block = worker_pb2.StepRequest(step_id=0), 0
    for i, length in enumerate(lengths):
        blocks = -(-length // block_size)
        request.new_seqs.add(seq_id=f"{prefix}-{i}", token_ids=[0] * length, num_prompt_tokens=length,
                             block_ids=range(next_block, next_block + blocks), num_scheduled_tokens=length,
                             sampling=sampling)
        next_block += blocks
    return request


def chunk_lengths(longest: int) -> list[int]:
    """1, 2, 4, ... up to the longest chunk a step may hold, and that one."""
    lengths, length = [], 1
    while length < longest:
        lengths.append(length)
        length *= 2
    return lengths + [longest]


def compile_kernels(runner, max_num_batched_tokens: int, max_model_len: int) -> None:
    """A prefill of every chunk length's tile size, then a decode after each (contexts both sides of the decode
    kernel's partition); lengths the pool cannot hold are left out."""
    block_size = runner.pool.block_size
    longest = min(max_num_batched_tokens, max_model_len - 1, runner.pool.num_blocks * block_size - 1)
    for length in chunk_lengths(longest):
        request = prefill_request([length], block_size)
        runner.step(request)
        decode = worker_pb2.StepRequest(step_id=0)
        decode.cached_seqs.add(seq_id=request.new_seqs[0].seq_id, num_computed_tokens=length, num_scheduled_tokens=1,
                               new_block_ids=[length // block_size] if length % block_size == 0 else [])
        runner.step(decode)
        runner.step(worker_pb2.StepRequest(step_id=0, freed_seq_ids=[request.new_seqs[0].seq_id]))
