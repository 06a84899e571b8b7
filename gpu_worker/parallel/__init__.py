"""Tensor parallelism: a model sharded across ranks, one device each, driven by rank 0 as one worker."""
