"""Decode steps replayed from CUDA graphs: the forward and the logits of a batch of one-token sequences, captured
once per bucketed batch size at start, then replayed over persistent input buffers (vLLM's cudagraph decode).

A decode step of a small model is ~35 kernel launches a layer; replaying them as one graph takes the launch cost
off the step. The graphs read every input from static buffers that a step fills (its rows, then padding rows
that store nothing and attend one slot), so the Triton backend's metadata is built once per batch size over those
buffers. With LoRA on, the graphs hold the adapters' products too, over the step's rows by adapter in fixed
buffers of their own (gpu_worker/lora/lora_slots.py's GraphRows). Capture is the only CUDA call: tests on the CPU
pass `capture=eager_capture`, which replays by running the forward again, so everything else here runs where no GPU is.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpu_worker.lora.lora_slots import LoraSlots
from gpu_worker.model import AttentionBatch
from kernels.staging import staged

log = logging.getLogger(__name__)

Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (vLLM's buckets): a batch pads to the next one."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 8, 8))
    return [s for s in sizes if s < max_batch] + [max_batch]


def cuda_capture(pool) -> Capture:
    """Capture fn into a CUDA graph sharing `pool` (torch.cuda.graph_pool_handle()) with the other sizes."""
    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = fn()
        return graph.replay, output
    return capture


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Stands in for a graph where there is no GPU: replay runs fn again, into the tensor the 'capture' returned."""
    output = fn()
    return lambda: output.copy_(fn()), output


@dataclass
class StaticInputs:
    """The persistent buffers every graph reads, max_batch rows each."""
    input_ids: torch.Tensor      # [B] int64
    positions: torch.Tensor      # [B] int64
    slots: torch.Tensor          # [B] int64, -1: stores nothing (padding, or a position in a shared block)
    block_tables: torch.Tensor   # [B, W] int32
    context_lens: torch.Tensor   # [B] int32
    cu_seqlens_q: torch.Tensor   # [B + 1] int32: 0, 1, 2, ... (every row is one query)

    @classmethod
    def allocate(cls, max_batch: int, table_width: int, device: torch.device) -> StaticInputs:
        longs = lambda: torch.zeros(max_batch, dtype=torch.long, device=device)  # noqa: E731
        return cls(longs(), longs(), torch.full((max_batch,), -1, dtype=torch.long, device=device),
                   torch.zeros(max_batch, table_width, dtype=torch.int32, device=device),
                   torch.ones(max_batch, dtype=torch.int32, device=device),
                   torch.arange(max_batch + 1, dtype=torch.int32, device=device))


@dataclass
class DecodeRows:
    """A decode step's rows on the host, in the order the graph computes them."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    lora_slots: list[int] = field(default_factory=list)   # with LoRA: each row's adapter slot, -1 the base model


class DecodeGraphs:
    """Captured decode forwards, one per batch size; run() takes a step's rows and returns their logits."""

    def __init__(self, model: torch.nn.Module, kv_layers: list, backend, block_size: int, max_batch: int,
                 max_model_len: int, device: torch.device, lora: LoraSlots | None = None):
        self.model, self.kv_layers, self.backend = model, kv_layers, backend
        self.block_size, self.device = block_size, device
        self.table_width = -(-max_model_len // block_size)
        self.sizes = batch_sizes(max_batch)
        self.inputs = StaticInputs.allocate(self.sizes[-1], self.table_width, device)
        self.lora = lora   # the adapters' slots, whose products the graphs hold (graphable ones only)
        self.lora_rows = lora.graph_rows(self.sizes[-1]) if lora is not None else None
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    @property
    def max_context_len(self) -> int:
        return self.table_width * self.block_size

    def capture_all(self, capture: Capture) -> None:
        """Largest first, so that the smaller graphs reuse its memory pool. Each size runs once eagerly before its
        capture: Triton compiles there, and cuBLAS picks its kernels."""
        with torch.inference_mode():
            for size in reversed(self.sizes):
                forward = self.forward_of(size)
                forward()
                self.graphs[size] = capture(forward)
        log.info("captured decode graphs for batch sizes %s", self.sizes)

    def forward_of(self, size: int) -> Callable[[], torch.Tensor]:
        inputs, kv_layers, model = self.inputs, self.kv_layers, self.model
        batch = AttentionBatch(self.backend, inputs.slots[:size], [(slice(0, size), self.metadata(size, 0))],
                               {w: [(slice(0, size), self.metadata(size, w))] for w in model.attention_windows})
        ids, positions = inputs.input_ids[:size], inputs.positions[:size]
        lora, lora_rows = self.lora, self.lora_rows

        def forward() -> torch.Tensor:
            if lora is None:
                return model.compute_logits(model(ids, positions, kv_layers, batch))
            lora.rows = lora_rows.view(size)
            try:
                return model.compute_logits(model(ids, positions, kv_layers, batch))
            finally:
                lora.rows = None
        return forward

    def metadata(self, size: int, window: int):
        return self.backend.PagedMetadata(self.inputs.block_tables[:size], self.inputs.context_lens[:size],
                                          self.inputs.cu_seqlens_q[:size + 1], 1, self.max_context_len, window)

    def fits(self, num_rows: int, longest_context: int) -> bool:
        return bool(self.graphs) and num_rows <= self.sizes[-1] and longest_context <= self.max_context_len

    def prepare(self, rows: DecodeRows) -> Callable[[], torch.Tensor]:
        """Fill the buffers (the rows, then padding) of the smallest graph that holds them; the returned call
        replays it and gives the rows' logits [n, V]."""
        n = len(rows.input_ids)
        size = next(s for s in self.sizes if s >= n)
        self.fill(rows, size)
        replay, logits = self.graphs[size]

        def run() -> torch.Tensor:
            replay()
            return logits[:n]
        return run

    def fill(self, rows: DecodeRows, size: int) -> None:
        pad = size - len(rows.input_ids)
        tables = torch.zeros(size, self.table_width, dtype=torch.int32)
        for i, table in enumerate(rows.block_tables):
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        longs = torch.tensor([rows.input_ids + [0] * pad, rows.positions + [0] * pad, rows.slots + [-1] * pad],
                             dtype=torch.long)
        lens = torch.tensor([p + 1 for p in rows.positions] + [1] * pad, dtype=torch.int32)
        longs, tables, lens = (staged(host, self.device) for host in (longs, tables, lens))
        inputs = self.inputs
        for target, source in ((inputs.input_ids[:size], longs[0]), (inputs.positions[:size], longs[1]),
                               (inputs.slots[:size], longs[2]), (inputs.block_tables[:size], tables),
                               (inputs.context_lens[:size], lens)):
            target.copy_(source, non_blocking=True)
        if self.lora_rows is not None:
            self.lora_rows.fill(rows.lora_slots + [-1] * pad)
