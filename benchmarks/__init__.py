"""Ferry's benchmarks, a room for each thing measured; every benchmark runs as `ferry bench NAME` (benchmarks/cli.py).

- `kernels/`: one operation alone on made-up tensors or rows: the attention kernels, the grammar engines.
- `engine/`: the in-process Engine (scheduler and worker in one process): throughput, steps against the
  machine's limits, KV memory, MoE, structured outputs, GGUF weights, exactness against transformers.
- `services/`: real processes over gRPC and HTTP: `ferry up` under load and under faults, the router against a
  synthetic scheduler, what the split and gRPC itself cost.
- `cluster/`: a simulated cluster of real schedulers on a discrete-event clock, its step cost model and its fit.
- `gpu/`: the check a fresh GPU machine runs (scripts/gpu_check.sh), steps drawn from the rooms above.
- `common/`: what the rooms share: workloads, the flags and report, plots, random-weight models.

The benchmarks import ferry and everything below it; ferry never imports them (tests/test_layering.py).
"""
