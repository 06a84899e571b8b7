"""The loader streams: a checkpoint's tensors are read one at a time into parameters allocated in the target
dtype, so host memory grows by about the model in that dtype, never by the checkpoint plus an fp32 copy."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.common.random_models import save_random_llama

MiB = 1 << 20
# 169M parameters: 675 MB in fp32, the largest tensor (embedding or head) 131 MB
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False)

LOAD = """
import json, sys, torch
from pathlib import Path
from transformers import AutoConfig
from gpu_worker.models import model_class
from gpu_worker.worker import Worker

def rss(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

model_dir = Path(sys.argv[1])
config = AutoConfig.from_pretrained(model_dir)
family = model_class(config.model_type)
shape = family.shape_from_config(config)
before = rss("VmRSS:")
model = Worker.load_model(family, shape, config, 256, model_dir, torch.bfloat16, torch.device("cpu"), None)
grown = rss("VmHWM:") - before
print(json.dumps({"grown": grown, "dtype": str(next(model.parameters()).dtype)}))
"""


@pytest.fixture(scope="module")
def big_fp32_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big")
    return save_random_llama(path, "tiny", torch.float32, **SHAPE)


def test_loading_a_fp32_checkpoint_in_bf16_grows_host_memory_by_about_the_bf16_model(big_fp32_model) -> None:
    checkpoint_bytes = sum(f.stat().st_size for f in big_fp32_model.glob("*.safetensors"))
    assert checkpoint_bytes > 500 * MiB
    run = subprocess.run([sys.executable, "-c", LOAD, str(big_fp32_model)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "torch.bfloat16"
    largest_fp32 = SHAPE["vocab_size"] * SHAPE["hidden_size"] * 4
    # the bf16 model, a fused tensor in flight, slack: the growth measured 543-626 MiB on one machine (the checkpoint's
    # mapped pages count while mapped), with the code of 2a72194 as now; an fp32 copy would add 320 MiB more
    bound = checkpoint_bytes // 2 + 2 * largest_fp32 + 128 * MiB
    assert result["grown"] < bound, f"host memory grew {result['grown'] / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
