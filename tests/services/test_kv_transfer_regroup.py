"""KV pulled between schedulers whose workers are groups of different sizes (2 ranks on gloo, and 1): the puller's
worker gathers every KV head from the holder's ranks' shares and cuts them again as its own ranks hold them, and
the pulled prefix is served token-exact against transformers, both ways."""
from __future__ import annotations

import pytest

from protos import scheduler_pb2
from tests.conftest import transformers_greedy
from tests.engine_fixtures import hf_model, random_prompts
from tests.services.test_kv_transfer import serve, stats
from tests.services_fixtures import greedy, start_services

__all__ = ["hf_model"]   # the shared fixture

BLOCK = 16
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def stacks(tiny_llama_dir):
    """One scheduler over a group of 2 ranks, one over a single rank (each its own stack: one set of flags each)."""
    group = start_services(tiny_llama_dir, num_schedulers=1, **{"--tensor-parallel-size": "2"})
    try:
        single = start_services(tiny_llama_dir, num_schedulers=1)
    except BaseException:
        group.stop()
        raise
    yield group, single
    single.stop()
    group.stop()


@pytest.mark.parametrize("direction", ["2 ranks to 1", "1 rank to 2"])
def test_a_prefix_pulled_between_groups_of_other_sizes_is_served_token_exact(stacks, hf_model, direction):
    holder, puller = stacks if direction == "2 ranks to 1" else stacks[::-1]
    prompt = random_prompts(seed=41 + len(direction), count=1, lengths=range(100, 101))[0]   # 6 full blocks
    expected = transformers_greedy(hf_model, [prompt], MAX_TOKENS)[0]
    assert serve(holder, 0, [prompt], greedy(MAX_TOKENS, ignore_eos=True)).tokens("r0") == expected
    before = stats(puller, 0)
    kv_source = scheduler_pb2.KvSource(scheduler_id="holder", address=holder.scheduler_addresses[0], num_blocks=6)
    pulled = serve(puller, 0, [prompt], greedy(MAX_TOKENS, ignore_eos=True), kv_source)
    after = stats(puller, 0)
    assert pulled.tokens("r0") == expected
    assert pulled.outputs["r0"][0].num_cached_tokens == 6 * BLOCK
    assert (after.kv_pulled_blocks - before.kv_pulled_blocks, after.kv_pull_failures) == (6, before.kv_pull_failures)
