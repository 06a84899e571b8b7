"""The GGUF blocks a model's linears multiply from are found in the file once, cached, and read from the cache on the
next start; a cache that is stale, corrupted, truncated or not the model's is rebuilt from the file, and a cache that
cannot be written leaves the start as it was."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from gpu_worker.cpu import quantized_linears
from gpu_worker.loading.model_files import gguf_blocks_dir
from kernels import cpu_quant
from tests.unit.gpu_worker.test_cpu_quant import random_blocks

pytestmark = pytest.mark.skipif(cpu_quant.extension() is None, reason="no C++ compiler for the CPU kernels")
SHAPES = {"Q4_1": (32, 64), "Q8_0": (64, 32)}   # [out, in]: the first two linears of tiny_model


@pytest.fixture(autouse=True)
def cache_in(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def file_reads(monkeypatch) -> list:
    """Each time a start parses the GGUF file."""
    reads, parse = [], quantized_linears.GgufRows

    def counted(gguf_file):
        reads.append(gguf_file)
        return parse(gguf_file)
    monkeypatch.setattr(quantized_linears, "GgufRows", counted)
    return reads


def file_blocks(seed: int) -> dict[str, np.ndarray]:
    """A Q4_1 and a Q8_0 tensor's blocks [rows, K / 32, block bytes]."""
    return {kind: random_blocks(kind, rows, columns, seed + offset)
            for offset, (kind, (rows, columns)) in enumerate(SHAPES.items())}


def write_gguf(path, blocks: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The file holding the blocks; returns their dequantized weights."""
    writer = gguf.GGUFWriter(str(path), "llama")
    weights = {}
    for kind, tensor in blocks.items():
        raw = tensor.reshape(tensor.shape[0], -1)
        writer.add_tensor(f"{kind.lower()}.weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        weights[kind] = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def tiny_model(weights: dict[str, torch.Tensor]) -> nn.Sequential:
    """The file's two weights, and a third linear of random weights that is in no file."""
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 64), nn.Linear(64, 64))
    with torch.no_grad():
        for linear, weight in zip(model, weights.values()):
            linear.weight.copy_(weight)
        generator = torch.Generator().manual_seed(0)
        for parameter in (model[1].bias, model[2].weight, model[2].bias):
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def start(gguf_file, weights) -> tuple[int, torch.Tensor]:
    """A worker start's replacement, then four rows through the model (the blocks' path)."""
    model = tiny_model(weights)
    replaced = quantized_linears.use_gguf_blocks(model, gguf_file)
    with torch.no_grad():
        return replaced, model(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))


def dense_outputs(weights) -> torch.Tensor:
    with torch.no_grad():
        return tiny_model(weights)(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))


def test_the_first_start_caches_the_blocks_and_the_second_reads_them_with_the_same_outputs(tmp_path, file_reads):
    weights = write_gguf(tmp_path / "tiny.gguf", file_blocks(seed=1))
    first = start(tmp_path / "tiny.gguf", weights)
    assert (gguf_blocks_dir(tmp_path / "tiny.gguf") / "blocks.safetensors").is_file()
    second = start(tmp_path / "tiny.gguf", weights)
    assert len(file_reads) == 1
    assert first[0] == second[0] == 2
    assert torch.equal(first[1], second[1])
    torch.testing.assert_close(second[1], dense_outputs(weights), atol=1e-4, rtol=1e-5)


def test_a_rewritten_gguf_file_rebuilds_the_cache(tmp_path, file_reads):
    blocks = file_blocks(seed=1)
    start(tmp_path / "tiny.gguf", write_gguf(tmp_path / "tiny.gguf", blocks))
    stat = (tmp_path / "tiny.gguf").stat()
    blocks["Q4_1"][1] = file_blocks(seed=2)["Q4_1"][1]   # one row, which the start's sampled check does not read
    weights = write_gguf(tmp_path / "tiny.gguf", blocks)   # and the same size: only the time tells it changed
    os.utime(tmp_path / "tiny.gguf", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    replaced, outputs = start(tmp_path / "tiny.gguf", weights)
    assert len(file_reads) == 2 and replaced == 2
    torch.testing.assert_close(outputs, dense_outputs(weights), atol=1e-4, rtol=1e-5)
    start(tmp_path / "tiny.gguf", weights)
    assert len(file_reads) == 2   # the rebuilt cache serves the next start


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path):
    path.write_text("{not json")


@pytest.mark.parametrize("damage, damaged_file", [(flip_a_byte, "blocks.safetensors"), (truncate, "blocks.safetensors"),
                                                  (garble, "blocks.json"), (os.unlink, "blocks.json")])
def test_a_damaged_cache_is_rebuilt_from_the_file(tmp_path, file_reads, damage, damaged_file):
    weights = write_gguf(tmp_path / "tiny.gguf", file_blocks(seed=1))
    expected = start(tmp_path / "tiny.gguf", weights)
    damage(gguf_blocks_dir(tmp_path / "tiny.gguf") / damaged_file)
    replaced, outputs = start(tmp_path / "tiny.gguf", weights)
    assert len(file_reads) == 2
    assert replaced == 2 and torch.equal(outputs, expected[1])
    start(tmp_path / "tiny.gguf", weights)
    assert len(file_reads) == 2


def test_cached_blocks_are_not_used_for_a_model_with_other_weights(tmp_path, file_reads):
    weights = write_gguf(tmp_path / "tiny.gguf", file_blocks(seed=1))
    start(tmp_path / "tiny.gguf", weights)
    other = {**weights, "Q4_1": cpu_quant.widened(cpu_quant.pack("Q4_1", random_blocks("Q4_1", 32, 64, seed=7)))}
    replaced, outputs = start(tmp_path / "tiny.gguf", other)   # converted from another file, say
    assert len(file_reads) == 2
    assert replaced == 1   # the Q8_0 weight is still the file's
    torch.testing.assert_close(outputs, dense_outputs(other), atol=1e-4, rtol=1e-5)


def test_a_cache_that_cannot_be_written_leaves_each_start_reading_the_file(tmp_path, monkeypatch, file_reads):
    (tmp_path / "not-a-directory").write_text("")
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "not-a-directory"))   # unwritable even for root
    weights = write_gguf(tmp_path / "tiny.gguf", file_blocks(seed=1))
    first, second = start(tmp_path / "tiny.gguf", weights), start(tmp_path / "tiny.gguf", weights)
    assert len(file_reads) == 2
    assert first[0] == second[0] == 2 and torch.equal(first[1], second[1])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_sampled_rows_widen_as_the_whole_weight_does(kind):
    weight = cpu_quant.pack(kind, random_blocks(kind, 64, 96, seed=3))
    columns = torch.tensor([0, 7, 8, 15])
    rows = torch.arange(4) * cpu_quant.PANEL + columns
    assert torch.equal(cpu_quant.widened_rows(weight, columns), cpu_quant.widened(weight)[rows])
