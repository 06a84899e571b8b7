"""EngineConfig's flags are generated from its fields and parse back into the same config; the benchmark baselines
(batching, kv_layout) have none, so no service takes them."""
from __future__ import annotations

import argparse

import pytest

from base.config import EngineConfig
from base.options import add_arguments, from_args, to_argv


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    return parser


def test_a_config_handed_over_as_flags_parses_back_into_the_same_config():
    config = EngineConfig(model="m", dtype="float32", max_num_seqs=7, enable_prefix_caching=False,
                          enforce_eager=True, announce_prompts=True, structured_output_compile_timeout=2.5)
    assert from_args(EngineConfig, engine_parser().parse_args(to_argv(config))) == config


def test_the_benchmark_baselines_are_set_in_process_and_are_no_service_flag():
    assert "--batching" not in engine_parser().format_help() and "--kv-layout" not in engine_parser().format_help()
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--batching", "static"])
    with pytest.raises(ValueError, match="kv_layout"):
        to_argv(EngineConfig(kv_layout="contiguous"))
