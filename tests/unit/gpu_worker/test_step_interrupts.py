"""A CPU step the scheduler asks to stop stops before its next layer and computes nothing the scheduler keeps: the
same positions sent again give the tokens an uninterrupted worker gives, though some layers' K and V were written."""
from __future__ import annotations

import random

from grpc_health.v1 import health

from gpu_worker.interrupts import Interrupts
from gpu_worker.process import WorkerService
from protos import worker_pb2
from tests.unit.gpu_worker.test_model import make_worker, new_seq, shuffled_blocks


class AskedDuringTheFirstLayer(Interrupts):
    """The scheduler's ask arriving while the step's first layer runs (the tiny model has two)."""

    def layers(self, layers, step_id):
        for index, layer in enumerate(super().layers(layers, step_id)):
            if index == 0 and step_id == 2:
                self.ask(step_id)
            yield layer


def two_steps(blocks: list[int]) -> tuple[worker_pb2.StepRequest, worker_pb2.StepRequest]:
    """A whole short prompt; then its decode beside the first chunk of a longer prompt."""
    rng = random.Random(5)
    short, long = [rng.randrange(3, 400) for _ in range(6)], [rng.randrange(3, 400) for _ in range(19)]
    first = worker_pb2.StepRequest(step_id=1, new_seqs=[new_seq("short", short, blocks[:2], 0, 6)])
    second = worker_pb2.StepRequest(step_id=2, new_seqs=[new_seq("long", long, blocks[4:9], 0, 12)])
    second.cached_seqs.add(seq_id="short", num_computed_tokens=6, num_scheduled_tokens=1)
    return first, second


def sampled(result: worker_pb2.StepResult) -> list[tuple[str, int, float]]:
    return [(s.seq_id, s.token_id, s.logprob.logprob) for s in result.sampled]


def test_a_step_asked_to_stop_between_layers_is_computed_again_to_the_same_tokens(tiny_llama_dir):
    reference, worker = make_worker(tiny_llama_dir), make_worker(tiny_llama_dir)
    first, second = two_steps(shuffled_blocks(reference.runner.pool.num_blocks, 12, seed=6))
    expected = [sampled(reference.step(first)), sampled(reference.step(second))]
    assert len(expected[1]) == 1   # the short prompt's decode; the long one's chunk samples nothing

    worker.runner.interrupts = AskedDuringTheFirstLayer()
    assert sampled(worker.step(first)) == expected[0]
    cut = worker.step(second)
    assert cut.interrupted and not cut.sampled and cut.step_id == 2
    again = worker_pb2.StepRequest(step_id=3)   # the scheduler sends the same positions as a new step
    again.cached_seqs.add(seq_id="long", num_computed_tokens=0, num_scheduled_tokens=12)
    again.cached_seqs.add(seq_id="short", num_computed_tokens=6, num_scheduled_tokens=1)
    assert sampled(worker.step(again)) == expected[1]


def test_an_ask_that_comes_before_its_step_stops_it_at_the_first_layer_and_others_are_not_touched(tiny_llama_dir):
    service = WorkerService(health.HealthServicer())
    service.worker = make_worker(tiny_llama_dir)
    first, second = two_steps(shuffled_blocks(service.worker.runner.pool.num_blocks, 12, seed=7))
    service.Interrupt(worker_pb2.InterruptRequest(step_id=2), None)   # what a late ask for step 2 looks like
    assert len(service.Step(first, None).sampled) == 1
    assert service.Step(second, None).interrupted


def test_a_step_with_grammar_masks_runs_to_its_end_when_asked(tiny_llama_dir):
    """Its masks were the scheduler's for this step only: it may not be cut short (nor one with proposals)."""
    worker = make_worker(tiny_llama_dir)
    first, _ = two_steps(shuffled_blocks(worker.runner.pool.num_blocks, 12, seed=8))
    vocab = worker.runner.model.shape.vocab_size
    first.token_bitmasks.add(seq_id="short", bits=b"\xff" * ((vocab + 31) // 32 * 4))
    worker.interrupt(first.step_id)
    result = worker.step(first)
    assert not result.interrupted and len(result.sampled) == 1
