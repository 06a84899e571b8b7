"""The in-process Engine (scheduler and worker in one process): throughput, a step against the machine's limits,
KV memory, MoE and structured-output steps, GGUF weights, token exactness against transformers."""
