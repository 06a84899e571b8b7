"""How long one engine step takes, from what the scheduler put in it: tokens prefilled, sequences decoded, and
context read by attention. Used by the cluster simulation (`ferry bench cluster`) in place of a worker.

    seconds = fixed + prefill_token * prefill tokens + decode_seq * decoded sequences + context_token * context read
              + prefill_context_token * context read by prefill rows

A decode row's attention streams its whole context from memory (context_token); a prefill chunk's rows read the
context together, tile by tile, and cost attention's arithmetic instead (prefill_context_token, per query row and
key: far less). Charging prefills the decode rate overstated a 2,048-token prefill's attention ~14x on `cpu` and
~50x on `h100_llama8b` (issue 42's P/D comparison is where it mattered); a fitted profile keeps one rate for both.

Two profiles built in, and any number fitted by `ferry bench cost-fit` (timed steps of the real engine, least
squares) and read from a JSON file: `benchmarks/cluster/profiles/` holds those of the machines BENCHMARKS.md names.

`cpu` — a 2-core AMD EPYC Zen 5 with AVX-512 (SmolLM2-135M bf16), fitted by hand to the steps measured in
BENCHMARKS.md on that machine:
  - `mixed` offline: 510 decode steps at a mean batch of 33.9 take ~21.3 s; attention 6.0 s over ~5.5 M context
    tokens read -> context_token ~1.0 us; a static batch of ~17 steps in 36 ms, of 32 in 47 ms, less their
    attention -> ~0.3 ms per decoded sequence on ~20 ms of fixed cost (weights streamed once a step);
  - a 2,048-token prefill step takes ~750 ms, ~150 ms of it attention -> prefill_token ~0.28 ms, and
    prefill_context_token 150 ms over its 2.1 M (query, key) pairs ~71 ns;
  - KV pool: the CPU default of 1 GiB at 23,040 bytes a token (30 layers x 3 KV heads x 64 dims x K+V x bf16)
    -> 46,603 tokens, 2,912 blocks; max_num_seqs 128 and max_num_batched_tokens 2,048, Ferry's defaults when
    fitted (a CPU's auto budget is 1,024 since);
  - a LoRA adapter made resident (`--adapters`): rank 16 on every linear PEFT targets, 30 layers x 16 x (q 576+576,
    k 576+192, v 576+192, o 576+576, gate and up 576+1,536, down 1,536+576) = 4.9 M parameters, 9.8 MB in bf16,
    copied from host memory into its slot at ~5 GB/s -> 2 ms (an estimate, not a measurement; `--lora-load-s`);
  - a pulled block (issue 42): 16 tokens x 23,040 bytes = 368,640 bytes, over loopback at 800 MB/s (assumed:
    a few hundred MB/s to ~1 GB/s for a gRPC stream between two processes on one host) -> 0.46 ms, 0.10 of the
    4.5 ms its prefill costs, the ratio the router's --kv-pull-cost defaults to; 1 ms to set a pull up.

`h100_llama8b` — one H100 SXM serving Llama-3.1-8B in bf16, from published specifications (not a measurement):
  - NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16;
  - Llama-3.1-8B config: 8.03 B parameters (16.1 GB in bf16), 32 layers, 8 KV heads x 128 dims -> 128 KiB of
    K+V per token (2 x 32 x 8 x 128 x 2 bytes);
  - fixed: the weights read once a step, 16.1 GB / 3.35 TB/s = 4.8 ms, taken as 6 ms (~80% of peak bandwidth
    plus launch overhead); prefill and each decoded sequence: 2 x 8.03 GFLOP per token at 60% of peak compute
    -> 27 us; context: 128 KiB per token read at 80% of peak bandwidth -> 49 ns; a prefill row's attention to
    one key: 4 x 4,096 x 32 = 0.52 MFLOP at 60% of peak compute -> 0.88 ns;
  - KV pool: 80 GB x 0.9 - 16.1 GB weights - ~4 GB activations ~ 52 GB -> ~400 k tokens (25,000 blocks of 16);
  - a LoRA adapter made resident: rank 16 on every linear, 32 layers x 16 x (q 4,096+4,096, k and v 4,096+1,024,
    o 4,096+4,096, gate and up 4,096+14,336, down 14,336+4,096) = 41.9 M parameters, 84 MB in bf16, from pinned
    host memory over PCIe 5 at ~25 GB/s -> 3.4 ms;
  - a pulled block: 16 tokens x 128 KiB = 2 MiB, at 25 GB/s (assumed: one 200 Gb/s RDMA NIC, or PCIe 5 through
    the host; NVLink within a node is ~10x more) -> 84 us, 0.19 of the 432 us its prefill costs; 1 ms to set up.
A fitted profile's adapter load and pull are the `cpu` profile's (cost-fit times neither).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from protos import worker_pb2


@dataclass(frozen=True)
class StepWork:
    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0      # KV entries attention reads, summed over every query row of the step
    prefill_context_tokens: int = 0   # the part of context_tokens read by prefill rows


@dataclass(frozen=True)
class CostProfile:
    name: str
    fixed_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    kv_blocks: int               # a scheduler's KV pool, in blocks of 16 tokens
    max_num_seqs: int
    max_num_batched_tokens: int
    lora_load_s: float = 0.002   # making one LoRA adapter resident, added to the step that first runs it
    kv_block_bytes: int = 368_640             # one block's K and V (a pull moves them: sim_kv_pull.py)
    kv_pull_bytes_per_s: float = 800e6        # a holder's link to the schedulers that pull from it
    kv_pull_latency_s: float = 0.001          # setting a pull up (the request and the layout check)
    prefill_context_token_s: float | None = None   # a prefill row's attention to one key (None: context_token_s)

    def step_seconds(self, work: StepWork) -> float:
        if not (work.prefill_tokens or work.decode_seqs):
            return 0.0
        prefill_rate = self.context_token_s if self.prefill_context_token_s is None else self.prefill_context_token_s
        return (self.fixed_s + self.prefill_token_s * work.prefill_tokens + self.decode_seq_s * work.decode_seqs
                + self.context_token_s * (work.context_tokens - work.prefill_context_tokens)
                + prefill_rate * work.prefill_context_tokens)


PROFILES = {p.name: p for p in (
    CostProfile("cpu", fixed_s=0.020, prefill_token_s=0.28e-3, decode_seq_s=0.3e-3, context_token_s=1.0e-6,
                kv_blocks=2912, max_num_seqs=128, max_num_batched_tokens=2048, lora_load_s=0.002,
                prefill_context_token_s=71e-9),
    CostProfile("h100_llama8b", fixed_s=0.006, prefill_token_s=27e-6, decode_seq_s=27e-6, context_token_s=49e-9,
                kv_blocks=25_000, max_num_seqs=256, max_num_batched_tokens=8192, lora_load_s=0.0034,
                kv_block_bytes=2 * 1024 * 1024, kv_pull_bytes_per_s=25e9, prefill_context_token_s=0.88e-9),
)}


def load_profile(name_or_path: str) -> CostProfile:
    """A built-in profile by name, or one written by `ferry bench cost-fit --out FILE`."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--profile: {name_or_path!r} is neither a file nor one of {sorted(PROFILES)}")
    return CostProfile(**json.loads(path.read_text()))


def chunk_work(num_computed: int, num_scheduled: int) -> StepWork:
    """One sequence's part of a step: a single new token is a decode, more is a prefill chunk; each query row
    reads the context before it and itself."""
    context = num_scheduled * num_computed + num_scheduled * (num_scheduled + 1) // 2
    if num_scheduled == 1:
        return StepWork(decode_seqs=1, context_tokens=context)
    return StepWork(prefill_tokens=num_scheduled, context_tokens=context, prefill_context_tokens=context)


def step_work(step: worker_pb2.StepRequest) -> StepWork:
    chunks = [chunk_work(seq.num_computed_tokens, seq.num_scheduled_tokens)
              for seq in [*step.new_seqs, *step.cached_seqs]]
    return StepWork(sum(w.prefill_tokens for w in chunks), sum(w.decode_seqs for w in chunks),
                    sum(w.context_tokens for w in chunks), sum(w.prefill_context_tokens for w in chunks))
