"""What the benchmark rooms share: workloads and their requests, the flags and JSON report, plots, random-weight
models."""
