"""KV pulled between schedulers whose workers are tensor-parallel groups of 2 ranks (gloo) with a draft model
(whole on rank 0): a block travels as rank 0's share, its draft's and rank 1's, and the pulled prefix is served
token-exact against transformers, the draft's proposals after it all kept (the draft is the model itself, so only a
draft KV pulled right proposes the target's tokens); a peer without the draft is refused, naming it."""
from __future__ import annotations

import json

import grpc
import pytest

from base.cluster_auth import token_metadata
from protos import scheduler_pb2
from tests.conftest import transformers_greedy
from tests.engine_fixtures import hf_model, random_prompts
from tests.services.test_kv_transfer import serve, source, stats, stub
from tests.services_fixtures import greedy, start_services

__all__ = ["hf_model"]   # the shared fixture

BLOCK = 16
MAX_TOKENS = 16
RANK_BLOCK_BYTES = 2 * 2 * 1 * BLOCK * 16 * 4   # tiny Llama: 2 layers, K and V, 1 of 2 KV heads, 16 dims, fp32


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    draft = json.dumps({"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3,
                        "disable_by_batch_size": 1024})
    services = start_services(tiny_llama_dir, num_schedulers=2, **{"--tensor-parallel-size": "2",
                                                                   "--speculative-config": draft})
    yield services
    services.stop()


def test_a_prefix_pulled_between_tensor_parallel_groups_with_a_draft_is_served_token_exact(stack, hf_model):
    prompt = random_prompts(seed=31, count=1, lengths=range(100, 101))[0]    # 6 full blocks before its last token
    expected = transformers_greedy(hf_model, [prompt], MAX_TOKENS)[0]
    assert serve(stack, 0, [prompt], greedy(MAX_TOKENS, ignore_eos=True)).tokens("r0") == expected
    before = stats(stack, 1)
    pulled = serve(stack, 1, [prompt], greedy(MAX_TOKENS, ignore_eos=True), source(stack, 0, 6))
    after = stats(stack, 1)
    assert pulled.tokens("r0") == expected
    assert pulled.outputs["r0"][0].num_cached_tokens == 6 * BLOCK
    # rank 0's share and its draft's (the same model, unsharded: two shares), and rank 1's
    assert after.kv_pulled_bytes - before.kv_pulled_bytes == 6 * 4 * RANK_BLOCK_BYTES
    assert after.kv_pull_failures == before.kv_pull_failures
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    kept = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert proposed > 0 and kept == proposed


def test_a_peer_without_the_draft_is_refused_naming_it(stack):
    mine = stats(stack, 0)
    layout = scheduler_pb2.KvLayout(model_name="tiny", dtype="float32", block_size=BLOCK, draft_model_name="")
    call = stub(stack, 0).FetchBlocks(scheduler_pb2.FetchBlocksRequest(block_hashes=[1], layout=layout),
                                      metadata=token_metadata(stack.cluster_token), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        list(call)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "draft_model_name: '' here" in refused.value.details()
    assert mine.kv_served_blocks == stats(stack, 0).kv_served_blocks
