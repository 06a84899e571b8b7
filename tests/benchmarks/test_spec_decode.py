"""`ferry bench spec-decode` and its copy-heavy workloads: deterministic prompts that carry the text a faithful answer
quotes, and a bench that runs speculation off and on over the same requests and reports whether their tokens match."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from benchmarks.common import copy_workloads
from benchmarks.engine import spec_decode


@pytest.mark.parametrize("name", list(copy_workloads.PROMPTS))
def test_copy_workloads_are_the_same_for_a_seed_and_differ_across_seeds(name):
    generate = copy_workloads.PROMPTS[name]
    assert generate(12, seed=3) == generate(12, seed=3)
    assert generate(12, seed=3) != generate(12, seed=4)
    assert len({p.message for p in generate(12, seed=3)}) == 12


def test_synthetic_prompts_alternate_passages_to_repeat_and_functions_to_rename():
    prompts = copy_workloads.synthetic_prompts(6, seed=1)
    assert [p.instruction for p in prompts] == [copy_workloads.REPEAT, copy_workloads.RENAME] * 3
    assert all(len(p.passage.split()) >= 60 for p in prompts[::2])
    for prompt in prompts[1::2]:
        code = prompt.passage.removeprefix("```python\n").removesuffix("```")
        compile(code, "<copy workload>", "exec")
        assert "x" in code.split("(", 1)[1].split(")", 1)[0].replace(" ", "").split(",")


def test_real_text_passages_are_prose_paragraphs_of_the_python_reference():
    paragraphs = copy_workloads.prose_paragraphs()
    assert len(paragraphs) > 100 and all(30 <= len(p.split()) <= 150 and p.endswith(".") for p in paragraphs)
    for prompt in copy_workloads.real_text_prompts(8, seed=0):
        assert len(prompt.passage.split()) >= 110
        assert all(part in paragraphs for part in prompt.passage.split("\n\n"))


@pytest.mark.parametrize("name", list(copy_workloads.PROMPTS))
def test_copy_requests_are_chat_prompts_that_contain_their_passages(name, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = copy_workloads.PROMPTS[name](4, seed=0)
    requests = copy_workloads.chat_requests(prompts, tokenizer, max_tokens=32)
    assert requests == copy_workloads.load(name, tokenizer, 4, max_tokens=32)
    for prompt, request in zip(prompts, requests):
        text = tokenizer.decode(request.prompt_token_ids)
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
        assert prompt.instruction in text and prompt.passage in text
        assert request.max_tokens == 32


def test_a_timeline_counts_tokens_of_one_step_as_arriving_together():
    timeline = spec_decode.Timeline(added=1.0)
    for now, tokens in [(1.5, [7]), (2.0, [8, 9, 10]), (2.5, [11])]:
        timeline.receive(now, tokens)
    assert timeline.ttft == 0.5 and timeline.itl == pytest.approx((2.5 - 1.5) / 4)
    assert timeline.steps == 3 and timeline.first_step_tokens == 1


def test_spec_decode_bench_runs_both_modes_at_each_level_with_the_same_outputs(tiny_llama_dir, capsys):
    assert spec_decode.main(["--model", str(tiny_llama_dir), "--dtype", "float32", "--batch-sizes", "1,2",
                             "--num-requests", "4", "--max-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [level["batch"] for level in result["levels"]] == [1, 2]
    assert result["speculative_config"]["method"] == "ngram" and result["mismatches"] == 0
    for level in result["levels"]:
        assert level["num_requests"] == 4 and level["mismatched"] == []
        for mode in ("off", "on"):
            stats = level[mode]
            assert stats["num_requests"] == 4 and 0 < stats["output_tokens"] <= 4 * 8
            assert stats["output_tokens_per_s"] > 0 and stats["ttft_ms_median"] > 0
            assert stats["itl_ms_median"] is None or stats["itl_ms_p90"] >= stats["itl_ms_median"] > 0
        assert level["off"]["output_tokens"] == level["on"]["output_tokens"]
        assert level["off"]["spec_proposed_tokens"] == 0
        assert 0 <= level["on"]["spec_accepted_tokens"] <= level["on"]["spec_proposed_tokens"]
        assert sum(level["on"]["spec_accepted_by_position"]) == level["on"]["spec_accepted_tokens"]
        assert level["on"]["spec_drafts"] == 0 or 0 <= level["on"]["mean_accepted_per_draft"] <= 4
        assert set(level["ratios"]) == {"output_tokens_per_s_on_over_off", "itl_median_on_over_off",
                                        "itl_p90_on_over_off"}
