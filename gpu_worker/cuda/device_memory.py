"""How much of a GPU the KV pool gets (vLLM's --gpu-memory-utilization): the fraction of the device's total memory
this worker may use, less the weights, the activations' peak measured by one profiling step at the largest
batch the scheduler may send, and what lies outside torch's allocator (the CUDA context, cuBLAS, other
processes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from base.sampling_params import SamplingParams
from gpu_worker.cuda.warm_up import prefill_request
from gpu_worker.kv_pool import KVPool
from protos import worker_pb2

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    total: int
    utilization: float
    weights: int
    activation_peak: int
    outside_torch: int

    @property
    def kv_bytes(self) -> int:
        return int(self.utilization * self.total) - self.weights - self.activation_peak - self.outside_torch

    def describe(self) -> str:
        gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        return (f"{self.utilization:.2f} x {gib(self.total)} = {gib(int(self.utilization * self.total))} allowed; "
                f"weights {gib(self.weights)}, activation peak {gib(self.activation_peak)}, outside torch "
                f"{gib(self.outside_torch)}; left for the KV cache {gib(self.kv_bytes)}")

    def checked_kv_bytes(self, block_bytes: int) -> int:
        """The KV budget, or a clear error where not one block fits (raise --gpu-memory-utilization, lower
        --max-num-batched-tokens / --max-num-seqs, or use a smaller model or dtype)."""
        if self.kv_bytes < block_bytes:
            raise ValueError(f"the model does not fit with room for its KV cache: {self.describe()} "
                             f"(one block needs {block_bytes / GiB:.4f} GiB)")
        return self.kv_bytes


def profile_requests(num_tokens: int, num_seqs: int, max_model_len: int, block_size: int
                     ) -> worker_pb2.StepRequest:
    """The largest step the scheduler may send: num_tokens prompt tokens over num_seqs sequences, each sampling
    with top-p (the sampler's widest path), in blocks 0, 1, 2, ... of a pool made for it."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [min(max_model_len, num_tokens // num_seqs + (i < num_tokens % num_seqs)) for i in range(num_seqs)]
    top_p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=1).to_proto()
    return prefill_request(lengths, block_size, top_p, prefix="profile")


def profile_blocks(request: worker_pb2.StepRequest) -> int:
    return sum(len(seq.block_ids) for seq in request.new_seqs)


def measure(make_runner, shape, dtype: torch.dtype, device: torch.device, utilization: float, num_tokens: int,
            num_seqs: int, max_model_len: int, block_size: int) -> MemoryPlan:
    """Run the profiling step through a runner over a pool of just its blocks, and read the device's memory."""
    request = profile_requests(num_tokens, num_seqs, max_model_len, block_size)
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    pool = KVPool.of_blocks(shape, block_size, profile_blocks(request), dtype, device)
    make_runner(pool).step(request)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - weights - pool.tensor.nbytes
    del pool
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    return MemoryPlan(total, utilization, weights, activation_peak, outside_torch)
