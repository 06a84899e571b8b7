"""Who crashed the worker (scheduler/crash_triage.py): a query of death is isolated in about log2(suspects) crashes
and blamed alone; a crash no request caused blames nobody; restarts back off while crashes come quickly."""
from __future__ import annotations

from base.sampling_params import SamplingParams
from scheduler.crash_triage import CrashTriage, Rejoining


def rejoining(request_id: str, generated: int = 3) -> Rejoining:
    return Rejoining(request_id, [1, 2, 3], SamplingParams(max_tokens=64, prompt_logprobs=2), list(range(generated)))


def test_a_query_of_death_among_many_suspects_is_found_and_only_it_is_blamed():
    triage, culprit = CrashTriage(), "r5"
    live = [rejoining(f"r{i}") for i in range(16)]
    admitted, blamed, crashes, generated = live, None, 0, {r.request_id: 3 for r in live}
    while blamed is None:
        # the worker crashes at the first step that holds the culprit; the others in it are suspects
        suspects = {r.request_id for r in admitted}
        assert culprit in suspects or not admitted
        crashes += 1
        admitted, blamed = triage.split([rejoining(rid, generated[rid]) for rid in sorted(suspects)], suspects)
        while blamed is None and culprit not in {r.request_id for r in admitted}:   # steps go well: held ones rejoin
            for r in admitted:
                generated[r.request_id] += 1
            admitted = triage.release(lambda rid: generated[rid])
    assert blamed.request_id == culprit
    assert crashes <= 4 + 1 + 1          # log2(16) halvings, the culprit on trial alone, and the first crash


def test_a_crash_no_request_caused_blames_nobody_and_everyone_rejoins():
    triage = CrashTriage()
    live = [rejoining("a"), rejoining("b"), rejoining("lone")]
    admitted, blamed = triage.split(live, {"lone"})     # the only request in flight when the worker was killed
    assert blamed is None and [r.request_id for r in admitted] == ["a", "b", "lone"]
    assert triage.release(lambda rid: {"a": 4, "b": 4, "lone": 4}[rid]) == [] and not triage.probing


def test_suspects_rejoin_half_at_a_time_and_the_rest_once_the_first_half_stepped_on():
    triage = CrashTriage()
    live = [rejoining("x"), rejoining("s1"), rejoining("s2"), rejoining("s3"), rejoining("s4")]
    admitted, _ = triage.split(live, {"s1", "s2", "s3", "s4"})
    assert [r.request_id for r in admitted] == ["x", "s1", "s2"]
    assert triage.release(lambda rid: {"s1": 4, "s2": 3}[rid]) == []          # s2 has not stepped on yet
    released = triage.release(lambda rid: {"s1": None, "s2": 4}[rid])         # s1 ended, s2 stepped on
    assert [r.request_id for r in released] == ["s3", "s4"]


def test_a_resumed_request_does_not_score_its_prompt_again():
    assert rejoining("r", generated=2).resumed_params().prompt_logprobs is None
    assert rejoining("r", generated=0).resumed_params().prompt_logprobs == 2


def test_restarts_back_off_while_crashes_come_quickly_and_start_over_after_a_quiet_spell():
    now = [0.0]
    triage = CrashTriage(clock=lambda: now[0])
    delays = []
    for _ in range(4):
        delays.append(triage.restart_delay())
        now[0] += 5.0
    now[0] += 600.0
    assert delays == [0.0, 1.0, 2.0, 4.0] and triage.restart_delay() == 0.0
