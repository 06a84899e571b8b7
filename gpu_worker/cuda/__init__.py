"""What the worker does only on a GPU: the KV pool sized by profiling, kernels compiled before ready, decode steps
from CUDA graphs."""
