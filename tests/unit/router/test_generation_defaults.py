"""The model's generation_config.json as vLLM applies it (--generation-config): defaults for what a request leaves
unset, max_new_tokens capping max_tokens, overrides on top, and the flags' mistakes named."""
from __future__ import annotations

import json

import pytest

from protos import common_pb2
from router.generation_defaults import GenerationConfig, apply_defaults, cached_defaults


@pytest.fixture
def model_dir(tmp_path):
    cached_defaults.cache_clear()
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "bos_token_id": 1}))
    return tmp_path


def test_the_models_defaults_fill_what_the_request_left_unset_and_max_new_tokens_caps_max_tokens(model_dir):
    sampling = common_pb2.SamplingParams(top_p=0.5, max_tokens=100)
    apply_defaults(sampling, GenerationConfig().defaults(str(model_dir)))
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == pytest.approx(
        (0.6, 0.5, 20, 64))
    assert not sampling.HasField("min_p") and not sampling.HasField("repetition_penalty")
    unset = common_pb2.SamplingParams()
    apply_defaults(unset, GenerationConfig().defaults(str(model_dir)))
    assert unset.max_tokens == 16   # the API's default, under the cap


def test_vllm_leaves_the_api_defaults_and_overrides_win(model_dir):
    assert GenerationConfig("vllm").defaults(str(model_dir)) == {}
    assert GenerationConfig("vllm", '{"temperature": 0.1}').defaults(str(model_dir)) == {"temperature": 0.1}
    assert GenerationConfig("auto", '{"top_k": 0}').defaults(str(model_dir))["top_k"] == 0
    sampling = common_pb2.SamplingParams()
    apply_defaults(sampling, {"top_k": 0})
    assert sampling.top_k == -1   # transformers' 0 is Ferry's (and vLLM's) -1: off


def test_a_folder_without_a_generation_config_gives_no_defaults(tmp_path):
    cached_defaults.cache_clear()
    assert GenerationConfig().defaults(str(tmp_path)) == {} and GenerationConfig().defaults("") == {}


@pytest.mark.parametrize("config, flag", [(GenerationConfig("/no/such/folder"), "--generation-config"),
                                          (GenerationConfig(overrides="{"), "--override-generation-config"),
                                          (GenerationConfig(overrides='{"seed": 3}'), "--override-generation-config")])
def test_the_flags_mistakes_are_named(config, flag):
    with pytest.raises(ValueError, match=flag):
        config.check()
