"""The worker: loads the model, sizes the KV pool, and runs one forward pass + sampling per Step."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from base.config import step_tokens
from base.speculative import parse_speculative_config
from gpu_worker.cpu import cpu_features, cpu_heap, cpu_linear, quantized_linears
from gpu_worker.cuda import device_memory, warm_up
from gpu_worker.cuda.cuda_graphs import DecodeGraphs, cuda_capture
from gpu_worker.draft_model import DraftModel
from gpu_worker.kv_blocks import WorkerBlocks
from gpu_worker.kv_pool import DEFAULT_CPU_KV_BYTES, KVPool, block_bytes
from gpu_worker.loading.model_files import gguf_source, language_model_config, resolve_model_dir
from gpu_worker.loading.weights import Checkpoint, load_weights
from gpu_worker.lora.attach import attach_lora
from gpu_worker.model import TorchLayerOps
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models import model_class
from gpu_worker.parallel.group import INIT, LOAD_ADAPTER, STEP, Followers, TensorParallel
from gpu_worker.parallel.sharding import ShardedCheckpoint, check_shardable, shard_model, shard_shape
from kernels import cpu_decode, cpu_layers, cpu_prefill, select_backend
from protos import common_pb2, worker_pb2

log = logging.getLogger(__name__)
MAX_DEFAULT_MODEL_LEN = 8192


def resolve_device(name: str) -> torch.device:
    if name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA and on CPUs that multiply bf16 natively, fp32 on other CPUs (gpu_worker/cpu/cpu_features)."""
    if name in ("", "auto"):
        return cpu_features.detect().auto_dtype if device.type == "cpu" else torch.bfloat16
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)} or auto, got {name!r}")
    if device.type == "cpu" and name == "float16":
        raise ValueError("dtype float16 is not supported on CPU: use bfloat16 or float32")
    return dtypes[name]


def device_info(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """What the worker runs on, for its start line and the scheduler's ferry:device_info metric."""
    info = {"device": device.type, "dtype": str(dtype).removeprefix("torch.")}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    else:
        info.update(cpu_features.detect().as_labels())
        module = cpu_decode.extension()
        info["cpu_kernels"] = module.vector_isa() if module is not None else "off"
    return info


def eos_token_ids(model_dir, hf_config) -> list[int]:
    ids = []
    generation_config = model_dir / "generation_config.json"
    for source in (json.loads(generation_config.read_text()).get("eos_token_id") if generation_config.is_file()
                   else None, hf_config.eos_token_id):
        if source is not None:
            ids.extend(source if isinstance(source, list) else [source])
    return sorted(set(ids))


def freeable_window(shape) -> int:
    """The window before which no layer reads, when every layer is local; 0 when some layer is global."""
    windows = shape.layer_windows
    return max(windows) if windows and all(windows) else 0


def kv_cache_bytes(req: worker_pb2.InitRequest, make_runner, shape, dtype: torch.dtype, device: torch.device,
                   block_size: int, max_model_len: int) -> int:
    """The KV pool's bytes: as asked; else 1 GiB on a CPU; else what --gpu-memory-utilization leaves on a GPU
    once the weights and a profiling step at the largest batch have taken theirs (gpu_worker/cuda/device_memory)."""
    if req.kv_cache_memory:
        return req.kv_cache_memory
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES
    plan = device_memory.measure(make_runner, shape, dtype, device, req.gpu_memory_utilization or 0.9,
                                 step_tokens(req.max_num_batched_tokens, "cuda"), req.max_num_seqs or 128,
                                 max_model_len, block_size)
    log.info("GPU memory: %s", plan.describe())
    return plan.checked_kv_bytes(block_bytes(shape, block_size, dtype))


def overlaps(setting: str, device: torch.device, tp: TensorParallel | None, draft) -> bool:
    """Whether steps launch before the previous one's tokens are back (worker_overlap): auto on a GPU. Never under
    tensor parallelism (rank 0 hands its ranks whole steps) or with a draft model (it proposes from the step's
    tokens on the host)."""
    if setting == "off":
        return False
    if tp is not None or draft is not None:
        if setting == "on":
            raise ValueError("worker_overlap on: not with tensor parallelism or a draft model")
        return False
    return setting == "on" or device.type == "cuda"


def capturable(model: torch.nn.Module, backend) -> bool:
    """CUDA graphs need a backend whose metadata the kernels read at launch (Triton's) and a forward that never
    waits for the device (no softcapped scores, which take the torch path; no mixture of experts, whose routing
    counts tokens per expert on the host)."""
    return getattr(backend, "CAPTURABLE", False) and not model.attention_softcap and getattr(model, "capturable", True)


class Worker:
    """One worker, or one rank of a tensor-parallel group (gpu_worker/parallel/): rank 0 is given no group and
    forms one when its Init asks for several ranks; the others are given theirs by their follower process."""

    def __init__(self, tp: TensorParallel | None = None, exit_with_group: bool = False) -> None:
        self.runner: ModelRunner | None = None
        self.overlaps = False   # steps are launched ahead of the previous one's tokens (launch(); worker_overlap)
        self.tp = tp
        self.followers: Followers | None = None   # rank 0's ranks 1..N-1
        self.blocks: WorkerBlocks | None = None   # the KV pools' blocks out and in (KV transfer)
        self.exit_with_group = exit_with_group    # a worker process: a rank's death ends it (group.py)

    def init(self, req: worker_pb2.InitRequest) -> worker_pb2.InitResponse:
        device = resolve_device(req.device)
        dtype = resolve_dtype(req.dtype, device)
        if device.type == "cpu":
            cpu_heap.keep_freed_memory()
        model_dir = resolve_model_dir(req.model)
        hf_config = language_model_config(model_dir)
        family = model_class(hf_config.model_type)
        whole_shape = family.shape_from_config(hf_config)
        self.start_group(req, whole_shape, device)
        if self.tp is not None:
            device = self.tp.device
        shape = shard_shape(whole_shape, self.tp.size) if self.tp else whole_shape
        max_model_len = req.max_model_len or min(shape.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
        model = self.load_model(family, shape, hf_config, max_model_len, model_dir, dtype, device,
                                gguf_source(req.model), self.tp, whole_shape)
        weight_bytes = model.weight_bytes
        block_size = req.block_size or 16
        backend = select_backend(req.attention_backend or "auto", device.type)
        if device.type == "cpu":
            cpu_decode.extension()   # built (or found in the cache) now, not in the first step
            cpu_prefill.extension()
        # both backends share the pool layout, so the fused CPU ops may store K and V for either
        model.layer_ops = (cpu_layers.layer_ops() if device.type == "cpu" else None) or TorchLayerOps(backend.store_kv)
        eos = eos_token_ids(model_dir, hf_config)
        # the adapters' device slots are allocated before the KV pool is sized from what memory is left
        lora = (attach_lora(model, shape, req, dtype, device, self.tp, whole_shape) if req.enable_lora
                else (None, None))

        def make_runner(pool: KVPool) -> ModelRunner:
            return ModelRunner(model, pool, backend, device, seed=req.seed, eos_token_ids=tuple(eos), tp=self.tp,
                               vocab_size=whole_shape.vocab_size)
        # under tensor parallelism the draft model runs whole on rank 0 alone: the others never propose
        draft = (self.load_draft(req, whole_shape, max_model_len, dtype, device, model.layer_ops)
                 if self.tp is None or self.tp.rank == 0 else None)
        kv_bytes = kv_cache_bytes(req, make_runner, shape, dtype, device, block_size, max_model_len)
        if self.tp is None and draft is None:
            pool = KVPool(shape, block_size, kv_bytes, dtype, device)
        else:   # a draft's pool holds the same blocks (the bytes shared in that proportion); under TP every rank's
            # pool has as many blocks, the group's one block table
            per_block = block_bytes(shape, block_size, dtype) + (block_bytes(draft[1], block_size, dtype) if draft
                                                                 else 0)
            num_blocks = kv_bytes // per_block
            if self.tp is not None:
                num_blocks = self.tp.minimum(num_blocks)
            pool = KVPool.of_blocks(shape, block_size, num_blocks, dtype, device)
        self.runner = make_runner(pool)
        self.runner.lora, self.runner.adapters = lora
        if draft is not None:
            draft_pool = KVPool.of_blocks(draft[1], block_size, pool.num_blocks, dtype, device)
            self.runner.draft = DraftModel(draft[0], draft_pool, max_model_len, draft[2])
        self.blocks = WorkerBlocks([pool] + ([self.runner.draft.pool] if draft else []), self.followers,
                                   whole_shape.num_kv_heads)
        if device.type == "cuda":
            warm_up.compile_kernels(self.runner, step_tokens(req.max_num_batched_tokens, "cuda"), max_model_len)
        if (device.type == "cuda" and not req.enforce_eager and capturable(model, backend) and draft is None
                and (lora[0] is None or lora[0].graphable) and self.tp is None):
            self.runner.graphs = DecodeGraphs(model, pool.layers, backend, block_size, req.max_num_seqs or 128,
                                              max_model_len, device, lora[0])
            self.runner.graphs.capture_all(cuda_capture(torch.cuda.graph_pool_handle()))
        self.overlaps = overlaps(req.worker_overlap or "auto", device, self.tp, draft)
        info = device_info(device, dtype)
        log.info("worker ready: %s on %s, %d KV blocks of %d tokens", model_dir.name,
                 " ".join(f"{key}={value}" for key, value in info.items()), pool.num_blocks, block_size)
        model_info = worker_pb2.ModelInfo(num_blocks=pool.num_blocks, block_size=block_size,
                                          max_model_len=max_model_len, vocab_size=whole_shape.vocab_size,
                                          eos_token_ids=eos,
                                          model_name=(req.served_model_name or [model_dir.name])[0],
                                          model_path=str(model_dir.resolve()), sliding_window=freeable_window(shape),
                                          kv_dtype=info["dtype"], num_layers=shape.num_layers,
                                          num_kv_heads=whole_shape.num_kv_heads, head_dim=shape.head_dim,
                                          tensor_parallel_size=self.tp.size if self.tp else 1,
                                          max_num_batched_tokens=step_tokens(req.max_num_batched_tokens, device.type),
                                          kv_block_bytes=self.blocks.bytes_per_block,
                                          draft_model_name=draft[2] if draft else "")
        rank_weight_bytes = self.tp.gather_ints(weight_bytes) if self.tp else [weight_bytes]
        if self.tp is not None:
            info["tensor_parallel_size"] = str(self.tp.size)
        return worker_pb2.InitResponse(model=model_info, device_info=info, rank_weight_bytes=rank_weight_bytes)

    def start_group(self, req: worker_pb2.InitRequest, shape, device: torch.device) -> None:
        """Rank 0 asked for several ranks: check the model splits evenly, start the others and hand them the
        Init (each loads its own shard)."""
        size = req.tensor_parallel_size or 1
        if size == 1 or self.tp is not None:
            return
        check_shardable(shape, size)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        self.followers = Followers.start(size, device.type, self.exit_with_group)
        self.tp = self.followers.group
        self.followers.send(INIT, req)

    def load_draft(self, req: worker_pb2.InitRequest, target, max_model_len: int, dtype: torch.dtype,
                   device: torch.device, layer_ops) -> tuple[torch.nn.Module, object, str] | None:
        """The speculative config's draft model, its shape and its name, checked against the target; None without
        one."""
        config = parse_speculative_config(req.speculative_config)
        if config is None or config.method != "draft_model":
            return None
        model_dir = resolve_model_dir(config.model)
        hf_config = language_model_config(model_dir)
        family = model_class(hf_config.model_type)
        shape = family.shape_from_config(hf_config)
        if shape.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {shape.vocab_size} tokens, the "
                             f"target's {target.vocab_size}: they must share one tokenizer")
        model = self.load_model(family, shape, hf_config, max_model_len, model_dir, dtype, device, None)
        if model.attention_windows or model.attention_softcap:
            raise ValueError("speculative_config.model: a draft model must attend to its whole context (no sliding "
                             "window, no softcapped scores)")
        model.layer_ops = layer_ops
        return model, shape, model_dir.name

    @staticmethod
    def load_model(family, shape, hf_config, max_model_len, model_dir, dtype, device, gguf_file: Path | None,
                   tp: TensorParallel | None = None, whole_shape=None) -> torch.nn.Module:
        """The model of `shape` (a rank's shard of whole_shape under tensor parallelism) with its weights.
        model.weight_bytes: its parameters' bytes as loaded, before any packing for the CPU."""
        with torch.device("meta"):
            model = family(shape)
            if tp is not None:
                shard_model(model, tp)
        model = model.to(dtype).to_empty(device=device)   # allocated once, in the dtype it computes in
        checkpoint = Checkpoint(model_dir)
        load_weights(model, ShardedCheckpoint(checkpoint, whole_shape or shape, tp) if tp else checkpoint)
        model.eval()
        model.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if cpu_linear.available(dtype, device):
            if gguf_file is not None and dtype == torch.float32 and tp is None:
                quantized_linears.use_gguf_blocks(model, gguf_file)   # before packing: it reads the fp32 weights
            cpu_linear.pack_linear_layers(model)
        model.load_rope(hf_config, max_model_len, device)
        return model

    def load_adapter(self, req: common_pb2.LoraAdapterRequest) -> worker_pb2.LoadAdapterResponse:
        """ValueError (gpu_worker.lora.peft_adapter.AdapterRefused) naming what does not fit."""
        if self.runner is None or self.runner.adapters is None:
            raise ValueError("LoRA is off: start with --enable-lora")
        weights = self.runner.adapters.load(req.name, req.path)   # refused here first: the ranks read it too
        if self.followers is not None:
            self.followers.send(LOAD_ADAPTER, req)
        return worker_pb2.LoadAdapterResponse(rank=weights.rank, target_modules=weights.target_modules)

    def read_blocks(self, req: worker_pb2.ReadBlocksRequest) -> worker_pb2.BlocksData:
        return worker_pb2.BlocksData(data=self.kv_blocks().read(list(req.block_ids), req.shm_path))

    def write_blocks(self, req: worker_pb2.WriteBlocksRequest) -> worker_pb2.BlocksData:
        self.kv_blocks().write(list(req.block_ids), req.data, req.shm_path, req.source_tensor_parallel_size)
        return worker_pb2.BlocksData()

    def kv_blocks(self) -> WorkerBlocks:
        if self.blocks is None:
            raise ValueError("the worker has no model yet")
        return self.blocks

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        """One step, start to end."""
        if self.runner is None:
            raise RuntimeError("Worker.step called before Worker.init")
        if self.followers is not None:
            self.followers.send(STEP, req)
        return self.runner.step(req)

    def interrupt(self, step_id: int) -> None:
        """Ask step step_id to stop before its next layer (gpu_worker/interrupts.py); called beside the steps."""
        if self.runner is not None:
            self.runner.interrupts.ask(step_id)

    def launch(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResult | None:
        """With overlap: start req on the device before the step launched before it is finished (its tokens feed
        req's positions there); that step's result, or None. finish() gives req's (ModelRunner.launch)."""
        if not self.overlaps:
            raise RuntimeError("Worker.launch without overlap (Worker.step runs one step at a time)")
        return self.runner.launch(req)

    def finish(self) -> worker_pb2.StepResult | None:
        """The launched step's result (None: none is unfinished)."""
        return self.runner.finish() if self.runner is not None else None

    @property
    def device_type(self) -> str:
        return self.runner.device.type if self.runner is not None else "cpu"

    def launched_ready(self) -> bool:
        """Whether finish() would return without waiting for the device."""
        unfinished = self.runner.unfinished if self.runner is not None else None
        return unfinished is None or unfinished.ready()
