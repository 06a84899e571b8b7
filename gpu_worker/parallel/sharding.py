"""How a model is cut across tensor-parallel ranks (Megatron-LM's scheme, as vLLM applies it): q, k, v and
gate, up column-parallel (each rank its heads and its slice of the MLP), o and down row-parallel (each rank's
partial sums added by one all-reduce per attention and one per MLP), the embedding and the head split by vocabulary.
With fewer KV heads than ranks each rank keeps the one KV head its query heads read (replicated). A mixture of
experts is sharded the same way inside every expert (tensor sharding, not expert sharding): every rank works on
every token at every layer, so no rank waits on a popular expert and no tokens travel between ranks; the price is
smaller matrices per expert.

Each rank reads only its slices from the checkpoint files (safetensors slices), so its host and device memory
hold about 1/N of the weights."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.loading.weights import Checkpoint
from gpu_worker.model import ModelShape
from gpu_worker.parallel.group import TensorParallel


def check_shardable(shape: ModelShape, size: int) -> None:
    """ValueError naming what does not split evenly across `size` ranks."""
    problems = []
    if shape.num_heads % size:
        problems.append(f"{shape.num_heads} attention heads")
    if shape.num_kv_heads % size and size % shape.num_kv_heads:
        problems.append(f"{shape.num_kv_heads} KV heads (neither a multiple nor a divisor of the ranks)")
    if shape.intermediate_size % size:
        problems.append(f"an MLP of {shape.intermediate_size}")
    if getattr(shape, "moe_intermediate_size", 0) % size:
        problems.append(f"experts of {shape.moe_intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {', '.join(problems)}")


def shard_shape(shape: ModelShape, size: int) -> ModelShape:
    """One rank's model: its heads, its slice of each MLP, its slice of the vocabulary (rounded up)."""
    local = dict(num_heads=shape.num_heads // size, num_kv_heads=max(1, shape.num_kv_heads // size),
                 intermediate_size=shape.intermediate_size // size, vocab_size=-(-shape.vocab_size // size))
    if getattr(shape, "moe_intermediate_size", 0):
        local["moe_intermediate_size"] = shape.moe_intermediate_size // size
    return dataclasses.replace(shape, **local)


class VocabParallelEmbedding(nn.Embedding):
    """The rows of the rank's slice of the vocabulary: tokens outside it embed to zero, and the all-reduce adds
    the one rank's row that holds each token."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel, vocab_start: int):
        super().__init__(num_embeddings, embedding_dim)
        self.tp, self.vocab_start = tp, vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(embedded.masked_fill_(outside.unsqueeze(-1), 0))


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """On the model built from shard_shape, before its weights: the vocabulary-parallel embedding (the head
    shares it where tied) and the all-reduce after every row-parallel linear (each part that has one)."""
    local = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(local.num_embeddings, local.embedding_dim, tp,
                                                tp.rank * local.num_embeddings)
    if model.shape.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():
        if hasattr(type(module), "all_reduce"):
            module.all_reduce = tp.all_reduce


class ShardedCheckpoint(Mapping):
    """A checkpoint's tensors as one rank sees them: the rank's slice of each split tensor, read alone from its
    file; the others whole. `shape` is the whole model's."""

    def __init__(self, checkpoint: Checkpoint, shape: ModelShape, tp: TensorParallel):
        self.checkpoint, self.shape, self.tp = checkpoint, shape, tp

    def __getitem__(self, name: str) -> torch.Tensor:
        split = self.split_of(name)
        if split is None:
            return self.checkpoint[name]
        dim, ranges, rows = split
        parts = [self.checkpoint.read_slice(name, dim, start, stop) for start, stop in ranges]
        tensor = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
        if rows > tensor.shape[0]:   # the last rank's short slice of the vocabulary, padded with rows never used
            tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self.checkpoint

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint)

    def __len__(self) -> int:
        return len(self.checkpoint)

    def split_of(self, name: str) -> tuple[int, list[tuple[int, int]], int] | None:
        """(dimension, ranges along it, rows after padding) of the rank's part of a split tensor; None: whole."""
        shape, tp = self.shape, self.tp
        part = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]   # "layers.0.self_attn.q_proj.weight" -> "q_proj"
        q, kv = self.query_range(), self.kv_range()
        inner = shape.moe_intermediate_size if ".experts." in name else shape.intermediate_size
        mlp = tp.shard(inner)
        if part in ("embed_tokens", "lm_head"):
            return 0, [tp.shard(shape.vocab_size)], -(-shape.vocab_size // tp.size)
        if part == "q_proj":
            return 0, [q], 0
        if part in ("k_proj", "v_proj"):
            return 0, [kv], 0
        if part == "qkv_proj":   # fused in the checkpoint (Phi-3): q, k and v rows one after another
            q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
            return 0, [q, offset(kv, q_rows), offset(kv, q_rows + kv_rows)], 0
        if part == "o_proj":
            return 1, [q], 0
        if part in ("gate_proj", "up_proj", "w1", "w3"):
            return 0, [mlp], 0
        if part == "gate_up_proj":   # fused in the checkpoint (Phi-3)
            return 0, [mlp, offset(mlp, inner)], 0
        if part in ("down_proj", "w2"):
            return 1, [mlp], 0
        return None

    def query_range(self) -> tuple[int, int]:
        return query_range(self.shape, self.tp)

    def kv_range(self) -> tuple[int, int]:
        return kv_range(self.shape, self.tp)


def query_range(shape: ModelShape, tp: TensorParallel) -> tuple[int, int]:
    """This rank's rows of q (the whole model's shape)."""
    heads = shape.num_heads // tp.size
    return head_rows(tp.rank * heads, heads, shape.head_dim)


def rank_heads(rank: int, size: int, num_kv_heads: int) -> range:
    """The KV heads rank `rank` of a group of `size` holds: its share, or, where the ranks outnumber the heads, the
    one its query heads read (held by several ranks)."""
    if num_kv_heads >= size:
        per_rank = num_kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * num_kv_heads // size
    return range(head, head + 1)


def kv_range(shape: ModelShape, tp: TensorParallel) -> tuple[int, int]:
    """This rank's KV heads' rows."""
    heads = rank_heads(tp.rank, tp.size, shape.num_kv_heads)
    return head_rows(heads.start, len(heads), shape.head_dim)


def shard_adapter_linears(linears: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], shape: ModelShape,
                          tp: TensorParallel) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA adapter's fused (A, B) pairs (gpu_worker/lora/peft_adapter.py) cut as their linears are: a
    column-parallel linear's B keeps the rank's output rows of each slice (A whole); a row-parallel linear's A keeps
    the rank's input columns (B whole), so that its partial product joins the linear's partial sums before their
    all-reduce. `shape` is the whole model's."""
    q, kv, mlp = query_range(shape, tp), kv_range(shape, tp), tp.shard(shape.intermediate_size)
    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    output_rows = {"qkv_proj": [q, offset(kv, q_rows), offset(kv, q_rows + kv_rows)],
                   "gate_up_proj": [mlp, offset(mlp, shape.intermediate_size)]}
    input_columns = {"o_proj": q, "down_proj": mlp}
    sharded = {}
    for (layer, linear), (a, b) in linears.items():
        if linear in output_rows:
            b = torch.cat([b[start:stop] for start, stop in output_rows[linear]])
        else:
            start, stop = input_columns[linear]
            a = a[:, start:stop]
        sharded[layer, linear] = (a.contiguous(), b.contiguous())
    return sharded


def head_rows(first_head: int, num_heads: int, head_dim: int) -> tuple[int, int]:
    return first_head * head_dim, (first_head + num_heads) * head_dim


def offset(span: tuple[int, int], by: int) -> tuple[int, int]:
    return span[0] + by, span[1] + by
