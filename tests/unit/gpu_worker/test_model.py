"""Ferry's model over the paged pool computes the same logits as Hugging Face transformers."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from base.sampling_params import SamplingParams
from gpu_worker.cpu import cpu_linear
from gpu_worker.model import TorchLayerOps
from gpu_worker.worker import Worker
from kernels import torch_paged
from protos import worker_pb2

BLOCK_SIZE = 4
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=8, logprobs=5).to_proto()


def make_worker(model_dir) -> Worker:
    worker = Worker()
    worker.init(worker_pb2.InitRequest(model=str(model_dir), dtype="float32", device="cpu",
                                       kv_cache_memory=1 << 22, block_size=BLOCK_SIZE))
    return worker


def reference_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def shuffled_blocks(num_blocks: int, count: int, seed: int) -> list[int]:
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return ids[:count]


def new_seq(seq_id, token_ids, blocks, computed, scheduled):
    return worker_pb2.NewSequence(seq_id=seq_id, token_ids=token_ids, num_prompt_tokens=len(token_ids),
                                  block_ids=blocks, num_computed_tokens=computed, num_scheduled_tokens=scheduled,
                                  sampling=GREEDY_LOGPROBS)


def assert_top_logprobs_match(entry, expected: torch.Tensor) -> None:
    top = torch.tensor([t.logprob for t in entry.top])
    ref_values, ref_ids = expected.topk(len(entry.top))
    assert [t.token_id for t in entry.top] == ref_ids.tolist()
    torch.testing.assert_close(top, ref_values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layer_ops", ["default", "torch"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_tied_dir"])
def test_prefill_and_fragmented_decode_match_transformers(fixture, layer_ops, request):
    model_dir = request.getfixturevalue(fixture)
    worker = make_worker(model_dir)
    if layer_ops == "torch":   # what CUDA runs; the default on this CPU is the fused C++ ops where they build
        worker.runner.model.layer_ops = TorchLayerOps(torch_paged.store_kv)
    prompt = [random.Random(1).randrange(3, 400) for _ in range(13)]
    blocks = shuffled_blocks(worker.runner.pool.num_blocks, 8, seed=2)
    result = worker.step(worker_pb2.StepRequest(new_seqs=[new_seq("a", prompt, blocks[:4], 0, len(prompt))]))
    tokens = prompt + [result.sampled[0].token_id]
    for _ in range(6):   # decode across block boundaries, one fragmented block appended when needed
        needed = (len(tokens) + BLOCK_SIZE - 1) // BLOCK_SIZE
        known = len(worker.runner.seqs["a"].block_ids)
        result = worker.step(worker_pb2.StepRequest(cached_seqs=[worker_pb2.CachedSequence(
            seq_id="a", new_block_ids=blocks[known:needed], num_computed_tokens=len(tokens) - 1,
            num_scheduled_tokens=1)]))
        tokens.append(result.sampled[0].token_id)
        expected = reference_logprobs(model_dir, tokens[:-1])[-1]
        assert result.sampled[0].token_id == int(expected.argmax())
        assert_top_logprobs_match(result.sampled[0].logprob, expected)


def test_chunked_prefill_and_batch_neighbours_give_the_same_logits(tiny_llama_dir):
    worker = make_worker(tiny_llama_dir)
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, 400) for _ in range(23)]
    short_prompt = [rng.randrange(3, 400) for _ in range(5)]
    blocks = shuffled_blocks(worker.runner.pool.num_blocks, 12, seed=4)
    # step 1: first 10 tokens of the long prompt and the whole short prompt, packed together
    first = worker.step(worker_pb2.StepRequest(new_seqs=[new_seq("long", long_prompt, blocks[:3], 0, 10),
                                                         new_seq("short", short_prompt, blocks[8:10], 0, 5)]))
    assert [s.seq_id for s in first.sampled] == ["short"]
    # step 2: the rest of the long prompt beside a decode of the short one
    second = worker.step(worker_pb2.StepRequest(cached_seqs=[
        worker_pb2.CachedSequence(seq_id="long", new_block_ids=blocks[3:6], num_computed_tokens=10,
                                  num_scheduled_tokens=13),
        worker_pb2.CachedSequence(seq_id="short", num_computed_tokens=5, num_scheduled_tokens=1)]))
    by_id = {s.seq_id: s for s in second.sampled}
    expected_long = reference_logprobs(tiny_llama_dir, long_prompt)[-1]
    assert by_id["long"].token_id == int(expected_long.argmax())
    assert_top_logprobs_match(by_id["long"].logprob, expected_long)
    expected_short = reference_logprobs(tiny_llama_dir, short_prompt + [first.sampled[0].token_id])[-1]
    assert_top_logprobs_match(by_id["short"].logprob, expected_short)


def test_bfloat16_runs_and_mostly_agrees_with_float32(tiny_llama_dir):
    worker = Worker()
    worker.init(worker_pb2.InitRequest(model=str(tiny_llama_dir), dtype="bfloat16", device="cpu",
                                       kv_cache_memory=1 << 22, block_size=BLOCK_SIZE))
    prompt = list(range(10, 30))
    result = worker.step(worker_pb2.StepRequest(new_seqs=[new_seq("a", prompt, [0, 1, 2, 3, 4], 0, len(prompt))]))
    expected = reference_logprobs(tiny_llama_dir, prompt)[-1]
    assert result.sampled[0].token_id in expected.topk(3).indices.tolist()


@pytest.mark.skipif(not cpu_linear.available(torch.bfloat16, torch.device("cpu")),
                    reason="oneDNN bf16 is not supported on this CPU")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bfloat16_linear_is_bit_identical_to_plain_linear(bias):
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    packed = cpu_linear.PackedLinear(plain)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(packed(x), plain(x))
    x = torch.randn(3, 7, 96, dtype=torch.bfloat16)   # leading dimensions other than rows
    assert torch.equal(packed(x), plain(x))


def test_bfloat16_worker_on_cpu_packs_its_linear_layers(tiny_llama_tied_dir):
    worker = Worker()
    worker.init(worker_pb2.InitRequest(model=str(tiny_llama_tied_dir), dtype="bfloat16", device="cpu",
                                       kv_cache_memory=1 << 22, block_size=BLOCK_SIZE))
    model = worker.runner.model
    expected = cpu_linear.PackedLinear if cpu_linear.available(torch.bfloat16, torch.device("cpu")) else torch.nn.Linear
    assert isinstance(model.lm_head, expected) and isinstance(model.layers[0].mlp.down_proj, expected)
    assert model.embed_tokens.weight.shape[0] == model.lm_head.out_features   # the tied embedding stays


def test_unknown_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        Worker().init(worker_pb2.InitRequest(model=str(tmp_path), dtype="float32", device="cpu"))
