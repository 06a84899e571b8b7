"""A test-only fault: with FERRY_TEST_CRASH_ON_TOKEN=<token id> in its environment, the worker kills itself (SIGKILL,
as a crash would) at the step that brings a sequence whose prompt holds that token. Tests use it to poison one
request through the real code paths; unset, it costs one check per step."""
from __future__ import annotations

import os
import signal

from base import environment
from protos import worker_pb2

CRASH_ON_TOKEN_ENV = "FERRY_TEST_CRASH_ON_TOKEN"


def poison_token() -> int | None:
    return environment.FERRY_TEST_CRASH_ON_TOKEN


def crash_if_poisoned(step: worker_pb2.StepRequest, token_id: int | None) -> None:
    if token_id is not None and any(token_id in seq.token_ids[:seq.num_prompt_tokens] for seq in step.new_seqs):
        os.kill(os.getpid(), signal.SIGKILL)
