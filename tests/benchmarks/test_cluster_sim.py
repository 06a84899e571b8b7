"""The cluster simulation: cost model and event loop on small cases with known answers, real schedulers and
policies inside, LoRA adapters' slots and loads, KV pulls, disaggregated prefill and decode, and small
`ferry bench cluster` runs."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pytest

from benchmarks.cluster.cluster_bench import RunSpec, prefill_count, router_policies, run_one, sim_requests, summarize
from benchmarks.cluster.cluster_sim import BLOCK_SIZE, MODEL, ClusterSim, SimRequest
from benchmarks.cluster.cost_fit import StepSample, fit
from benchmarks.cluster.cost_model import PROFILES, StepWork, chunk_work, load_profile, step_work
from benchmarks.cluster.long_mix import long_mix
from benchmarks.cluster.sim_adapters import AdapterSetup
from benchmarks.cluster.sim_disagg import DisaggregatedSim
from benchmarks.cluster.sim_kv_pull import install
from benchmarks.cluster.tenants_file import main as tenants_file
from benchmarks.common import workloads
from protos import worker_pb2
from protos.block_hash import hash_blocks
from protos.registration import SchedulerInfo
from router.kv_pull import KvPull
from router.policy import POLICIES, RoutingInput, RoutingPlan
from scheduler.block_manager import BlockManager
from scheduler.kv_transfer import CHUNK_BYTES

SECONDS_PER_STEP = replace(PROFILES["cpu"], name="one_second_steps", fixed_s=1.0, prefill_token_s=0.0,
                           decode_seq_s=0.0, context_token_s=0.0, kv_blocks=64, prefill_context_token_s=0.0)
SECONDS_PER_PREFILL_TOKEN = replace(SECONDS_PER_STEP, name="prefill_only", fixed_s=0.0, prefill_token_s=0.01)


def test_a_chunk_reads_the_context_before_each_of_its_rows():
    assert chunk_work(0, 4) == StepWork(prefill_tokens=4, context_tokens=10, prefill_context_tokens=1 + 2 + 3 + 4)
    assert chunk_work(10, 1) == StepWork(decode_seqs=1, context_tokens=11)
    assert chunk_work(16, 3) == StepWork(prefill_tokens=3, context_tokens=54, prefill_context_tokens=17 + 18 + 19)


def test_step_cost_adds_fixed_prefill_decode_and_context_terms():
    profile = replace(PROFILES["cpu"], fixed_s=0.5, prefill_token_s=0.1, decode_seq_s=0.01, context_token_s=0.001)
    assert profile.step_seconds(StepWork(prefill_tokens=10, decode_seqs=3, context_tokens=100)) == pytest.approx(
        0.5 + 1.0 + 0.03 + 0.1)
    assert profile.step_seconds(StepWork()) == 0.0        # a step that only frees sequences runs no forward


def test_prefill_rows_pay_their_own_attention_rate_and_a_fitted_profile_one_rate_for_both():
    work = StepWork(prefill_tokens=2, decode_seqs=1, context_tokens=100, prefill_context_tokens=60)
    profile = replace(PROFILES["cpu"], fixed_s=0.0, prefill_token_s=0.0, decode_seq_s=0.0, context_token_s=0.01,
                      prefill_context_token_s=0.001)
    assert profile.step_seconds(work) == pytest.approx(40 * 0.01 + 60 * 0.001)
    assert replace(profile, prefill_context_token_s=None).step_seconds(work) == pytest.approx(100 * 0.01)


def test_step_work_reads_new_and_cached_sequences_of_a_step():
    step = worker_pb2.StepRequest()
    step.new_seqs.add(seq_id="a", num_computed_tokens=0, num_scheduled_tokens=4)
    step.cached_seqs.add(seq_id="b", num_computed_tokens=10, num_scheduled_tokens=1)
    assert step_work(step) == StepWork(prefill_tokens=4, decode_seqs=1, context_tokens=10 + 11,
                                       prefill_context_tokens=10)


def one_scheduler(profile=SECONDS_PER_STEP, policy: str = "round_robin", num_schedulers: int = 1) -> ClusterSim:
    return ClusterSim(num_schedulers, profile, POLICIES[policy]())


def test_one_request_takes_one_step_per_token_and_its_first_token_ends_the_prefill_step():
    sim = one_scheduler()
    [request] = sim.run([SimRequest("r", 0.5, list(range(100, 132)), max_tokens=3)])
    assert (request.first_token_s, request.finished_s, request.num_output_tokens) == (1.5, 3.5, 3)
    assert sim.nodes["sched-00"].busy_s == 3.0


def test_a_request_arriving_while_another_runs_joins_the_next_step():
    sim = one_scheduler()
    first, second = sim.run([SimRequest("a", 0.0, list(range(100, 132)), 4),
                             SimRequest("b", 0.2, list(range(200, 232)), 2)])
    assert first.finished_s == 4.0
    assert (second.first_token_s, second.finished_s) == (2.0, 3.0)


def test_a_later_request_finds_the_shared_prefix_cached_and_prefills_only_the_rest():
    sim = one_scheduler(SECONDS_PER_PREFILL_TOKEN)
    prefix = list(range(100, 132))                        # two full blocks
    first, second = sim.run([SimRequest("a", 0.0, prefix + list(range(500, 516)), 1),
                             SimRequest("b", 10.0, prefix + list(range(600, 616)), 1)])
    assert first.first_token_s - first.arrival_s == pytest.approx(48 * 0.01)
    assert second.first_token_s - second.arrival_s == pytest.approx(16 * 0.01)
    counters = sim.nodes["sched-00"].scheduler.block_manager.counters
    assert (counters.queries, counters.hits) == (96, 32)


def test_the_prefix_index_holds_what_the_schedulers_kv_events_published():
    sim = one_scheduler()
    prompt = list(range(100, 148))
    sim.run([SimRequest("a", 0.0, prompt, 1)])
    hashes = hash_blocks(prompt, BLOCK_SIZE, MODEL)
    assert sim.index.matches(hashes, set(sim.nodes)) == {"sched-00": 3}
    assert sim.nodes["sched-00"].scheduler.block_manager.cached.keys() >= set(hashes)


@dataclass
class SeenByRouter:
    """Round robin that notes, per request, the prefix index's matches and the registrations it was routed on."""
    matched: dict[str, dict[str, int]] = field(default_factory=dict)
    waiting: dict[str, list[int]] = field(default_factory=dict)

    def __call__(self, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
        self.matched[request.request_id] = dict(request.matched_blocks)
        self.waiting[request.request_id] = [c.num_waiting + c.num_running for c in candidates]
        return sorted(candidates, key=lambda info: info.scheduler_id)


def test_kv_events_reach_the_prefix_index_kv_event_lag_s_after_the_step():
    seen = SeenByRouter()
    sim = ClusterSim(1, SECONDS_PER_PREFILL_TOKEN, seen, kv_event_lag_s=0.5)
    prefix = list(range(100, 132))                            # a's prefill ends at 0.33 s, its events land at 0.83
    sim.run([SimRequest("a", 0.0, prefix + [1], 1), SimRequest("b", 0.5, prefix + [2], 1),
             SimRequest("c", 1.0, prefix + [3], 1)])
    assert (seen.matched["b"], seen.matched["c"]) == ({}, {"sched-00": 2})


def test_the_router_sees_a_heartbeat_only_once_it_reads_the_registrations():
    seen = SeenByRouter()
    sim = ClusterSim(1, SECONDS_PER_STEP, seen, registration_read_s=0.5)   # heartbeats at 1, 2 s; reads at 0.25,
    #                                                                          0.75, 1.25 s...
    requests = [SimRequest("a", 0.0, list(range(100, 132)), 3)] + [
        SimRequest(name, at, list(range(200 + 40 * i, 232 + 40 * i)), 1)
        for i, (name, at) in enumerate((("b", 0.9), ("c", 1.2), ("d", 1.6)))]
    sim.run(requests)
    assert [seen.waiting[r][0] for r in "bcd"] == [0, 0, 2]    # the 1 s heartbeat (a and b there) read at 1.25 s


@pytest.mark.parametrize("policy, second_hits", [("cache_aware", True), ("round_robin", False)])
def test_the_real_policy_picks_among_simulated_schedulers(policy: str, second_hits: bool):
    sim = one_scheduler(SECONDS_PER_PREFILL_TOKEN, policy, num_schedulers=2)
    prefix = list(range(100, 164))
    first, second = sim.run([SimRequest("a", 0.0, prefix + [7], 1), SimRequest("b", 5.0, prefix + [8], 1)])
    assert (first.scheduler_id == second.scheduler_id) == second_hits
    hits = sum(n.scheduler.block_manager.counters.hits for n in sim.nodes.values())
    assert hits == (64 if second_hits else 0)


def test_a_full_queue_sends_the_request_to_the_next_scheduler():
    from scheduler.admission import AdmissionLimits

    profile = replace(SECONDS_PER_STEP, max_num_seqs=1)
    sim = ClusterSim(2, profile, POLICIES["cache_aware"](), limits=AdmissionLimits(max_queued_requests=1))
    prompt = list(range(100, 132))
    done = sim.run([SimRequest(f"r{i}", 0.0, prompt + [i], 2) for i in range(3)])
    assert all(r.finished_s is not None for r in done)
    assert len({r.scheduler_id for r in done}) == 2


@dataclass
class RecordingPolicy:
    """A router's policy that remembers what it routed and which finishes it was told of."""
    routed: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def __call__(self, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
        self.routed.append(request.request_id)
        return sorted(candidates, key=lambda info: info.scheduler_id)

    def finish(self, request_id: str) -> None:
        self.finished.append(request_id)


def test_two_routers_take_arrivals_in_turn_and_each_hears_the_finishes_of_its_own_requests():
    first, second = RecordingPolicy(), RecordingPolicy()
    sim = ClusterSim(2, SECONDS_PER_STEP, [first, second])
    done = sim.run([SimRequest(f"r{i}", 0.1 * i, list(range(100 + 40 * i, 132 + 40 * i)), 2 + i % 3)
                    for i in range(5)])
    assert (first.routed, second.routed) == (["r0", "r2", "r4"], ["r1", "r3"])
    assert sorted(first.finished) == first.routed and sorted(second.finished) == second.routed
    assert first.finished != first.routed        # r4 (3 tokens) ends before r2 (4): finishes come in their own order
    assert all(r.finished_s is not None for r in done)
    assert all(router.pending == {"sched-00": 0} for router in sim.routers)   # each router's in-flight count


def test_one_router_in_a_list_runs_exactly_as_the_single_router_simulation():
    requests = workloads.load("tenants", num_requests=120)
    spec = RunSpec(4, "cache_aware", 2.0, "h100_llama8b", kv_blocks=512, num_routers=1)
    single = ClusterSim(4, load_profile("h100_llama8b"), router_policies(spec)[0], kv_blocks=512,
                        registration_read_s=spec.registration_read_s, kv_event_lag_s=spec.kv_event_lag_s)
    single_runs = summarize(spec, single, single.run(sim_requests(requests, spec.rate, spec.seed)))
    assert run_one(spec, requests) == single_runs
    multi = run_one(replace(spec, num_routers=4), requests)
    assert multi["completed"] == single_runs["completed"] == 120
    assert multi != {**single_runs, "num_routers": 4}   # four routers' histories route differently


def test_each_router_builds_its_own_cache_aware_policy_whose_window_is_one_heartbeat():
    first, second = router_policies(RunSpec(4, "cache_aware", 1.0, "h100_llama8b", num_routers=2, heartbeat_s=0.25))
    assert first is not second and first.history is not second.history
    assert first.recent_window_s == second.recent_window_s == 0.25


@pytest.mark.parametrize("announce_prompts", [False, True])
def test_an_admitted_prompt_enters_the_prefix_index_before_its_prefill_only_if_announced(announce_prompts: bool):
    sim = ClusterSim(2, SECONDS_PER_STEP, POLICIES["cache_aware"](), announce_prompts=announce_prompts)
    prompt = list(range(100, 148))
    request = SimRequest("a", 0.0, prompt, 1, block_hashes=hash_blocks(prompt, BLOCK_SIZE, MODEL))
    sim.requests["a"] = request
    sim.arrive(request)                                   # admitted; its first step has not ended yet
    expected = {request.scheduler_id: 3} if announce_prompts else {}
    assert sim.index.matches(request.block_hashes, set(sim.nodes)) == expected


def test_ferry_bench_cluster_runs_a_small_sweep_and_writes_its_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "cluster", "--num-schedulers", "2,3",
                          "--num-requests", "30", "--rates-per-scheduler", "0.5,2", "--policies",
                          "round_robin,cache_aware", "--plot-dir", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout)
    assert len(result["runs"]) == 2 * 2 * 2
    assert all(r["completed"] == 30 and r["ttft_s"]["p50"] > 0 and r["output_tokens_per_s"] > 0
               for r in result["runs"])
    assert set(result["claims"]) == {"2", "3"}
    assert (tmp_path / "cluster_tenants_cpu_n2-3.png").stat().st_size > 0


def cost_samples(coefficients: tuple[float, float, float, float]) -> list[StepSample]:
    works = [StepWork(prefill, decode, context) for prefill in (0, 64, 2048) for decode in (0, 1, 32)
             for context in (100, 5000, 90000) if prefill or decode]
    fixed, prefill_s, decode_s, context_s = coefficients
    return [StepSample(w, fixed + prefill_s * w.prefill_tokens + decode_s * w.decode_seqs
                       + context_s * w.context_tokens) for w in works]


def test_cost_fit_recovers_the_coefficients_that_made_the_steps():
    fitted = fit(cost_samples((0.02, 0.28e-3, 0.3e-3, 1.0e-6)))
    assert fitted == pytest.approx({"fixed_s": 0.02, "prefill_token_s": 0.28e-3, "decode_seq_s": 0.3e-3,
                                    "context_token_s": 1.0e-6}, rel=1e-6)


def test_cost_fit_drops_a_term_that_would_come_out_negative():
    fitted = fit(cost_samples((0.02, 0.28e-3, 0.3e-3, -1.0e-7)))
    assert fitted["context_token_s"] == 0.0
    assert all(value > 0 for name, value in fitted.items() if name != "context_token_s")


def test_a_fitted_profile_file_drives_the_cluster_simulation(tiny_llama_dir, tmp_path):
    profile = tmp_path / "tiny.json"
    fitted = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "cost-fit", "--model", str(tiny_llama_dir),
                             "--threads", "1", "--name", "tiny", "--out", str(profile), "--json"],
                            capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(fitted.stdout)
    assert result["num_steps"] > 20 and result["profile"]["name"] == "tiny"
    assert load_profile(str(profile)).fixed_s == result["profile"]["fixed_s"]
    out = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "cluster", "--profile", str(profile),
                          "--num-schedulers", "2", "--num-requests", "10", "--rates-per-scheduler", "1",
                          "--policies", "cache_aware", "--json"], capture_output=True, text=True, timeout=300,
                         check=True)
    assert json.loads(out.stdout)["runs"][0]["completed"] == 10


def test_an_unknown_profile_is_named_in_the_error():
    with pytest.raises(ValueError, match="no-such-profile"):
        load_profile("no-such-profile")


# --- LoRA adapters -----------------------------------------------------------------------------------------
def adapter_sim(load_s: float = 0.5, max_loras: int = 1, num_schedulers: int = 1,
                policy: str = "round_robin") -> ClusterSim:
    return ClusterSim(num_schedulers, SECONDS_PER_STEP, POLICIES[policy](),
                      adapters=AdapterSetup(("a", "b"), max_loras, load_s))


def test_the_first_step_of_a_request_whose_adapter_is_not_resident_pays_its_load():
    sim = adapter_sim()
    first, second = sim.run([SimRequest("r0", 0.0, list(range(100, 132)), 1, adapter="a"),
                             SimRequest("r1", 5.0, list(range(200, 232)), 1, adapter="a")])
    assert first.first_token_s - first.arrival_s == 1.5                   # a one-second step and the load
    assert second.first_token_s - second.arrival_s == 1.0                 # resident since
    assert sim.nodes["sched-00"].adapter_loads == 1


def test_a_request_waits_for_a_slot_while_every_slot_holds_an_adapter_in_use():
    sim = adapter_sim(load_s=0.0)
    first, second = sim.run([SimRequest("r0", 0.0, list(range(100, 132)), 3, adapter="a"),
                             SimRequest("r1", 0.1, list(range(200, 232)), 1, adapter="b")])
    assert second.first_token_s >= first.finished_s                      # one slot: b waited for a to finish
    assert sim.nodes["sched-00"].slot_waits == 1


def test_the_simulated_prefix_cache_never_shares_kv_across_adapters():
    sim = ClusterSim(1, SECONDS_PER_PREFILL_TOKEN, POLICIES["round_robin"](),
                     adapters=AdapterSetup(("a", "b"), max_loras=2))
    prompt = list(range(100, 148))
    sim.run([SimRequest("r0", 0.0, prompt, 1, adapter="a"), SimRequest("r1", 10.0, prompt, 1, adapter="b"),
             SimRequest("r2", 20.0, prompt, 1, adapter="a")])
    assert sim.nodes["sched-00"].scheduler.block_manager.counters.hits == 32   # only r2 finds a's blocks
    assert sim.index.matches(hash_blocks(prompt, BLOCK_SIZE, MODEL, adapter="b"), set(sim.nodes)) == {"sched-00": 3}


def test_adapter_aware_routing_loads_adapters_less_often_than_adapter_blind_routing():
    requests = workloads.load("tenants", num_requests=200)
    runs = {policy: run_one(RunSpec(4, policy, 1.0, "cpu", kv_blocks=1024, num_adapters=16), requests)
            for policy in ("adapter_blind", "cache_aware")}
    assert all(r["completed"] == 200 for r in runs.values())
    aware, blind = runs["cache_aware"], runs["adapter_blind"]
    assert aware["adapter_loads"] < blind["adapter_loads"] and aware["slot_waits"] < blind["slot_waits"]


def test_ferry_bench_cluster_compares_adapter_aware_and_blind_routing():
    out = subprocess.run([sys.executable, "-m", "ferry.cli", "bench", "cluster", "--num-schedulers", "2",
                          "--num-requests", "30", "--rates-per-scheduler", "1", "--policies",
                          "adapter_blind,cache_aware", "--adapters", "4", "--max-loras", "2", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout)
    assert [(r["policy"], r["adapters"], r["max_loras"], r["completed"]) for r in result["runs"]] == [
        ("adapter_blind", 4, 2, 30), ("cache_aware", 4, 2, 30)]
    assert all(r["adapter_loads"] >= 2 and r["lora_load_s"] == 0.002 for r in result["runs"])
    assert set(result["claims"]["2"]["adapter_blind/cache_aware"]["2.0"]) == {"ttft_p50", "ttft_p90",
                                                                              "adapter_loads"}


# --- pulling a prefix from its holder (issue 42), closed-loop clients ---------------------------------------
@dataclass
class PullFromFirst:
    """A router that sends the first request to sched-00 and every later one to sched-01, pulling from sched-00."""
    routed: int = 0

    def plan(self, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> RoutingPlan:
        ordered = sorted(candidates, key=lambda info: info.scheduler_id)
        self.routed += 1
        if self.routed == 1:
            return RoutingPlan(ordered)
        return RoutingPlan(ordered[::-1], {"sched-01": KvPull(ordered[0], request.matched_blocks["sched-00"])})

    def __call__(self, candidates: Sequence[SchedulerInfo], request: RoutingInput) -> list[SchedulerInfo]:
        return self.plan(candidates, request).ranked


def test_a_pulled_prefix_costs_its_transfer_instead_of_its_prefill_and_unpins_the_holders_blocks():
    profile = replace(SECONDS_PER_PREFILL_TOKEN, kv_block_bytes=1000, kv_pull_bytes_per_s=10_000,
                      kv_pull_latency_s=0.05)                 # 0.1 s a block, against 0.16 s to prefill one
    sim = ClusterSim(2, profile, PullFromFirst())
    prefix = list(range(100, 132))                            # two full blocks
    first, second = sim.run([SimRequest("a", 0.0, prefix + list(range(500, 516)), 1),
                             SimRequest("b", 10.0, prefix + list(range(600, 616)), 1)])
    assert second.scheduler_id == "sched-01"
    assert second.first_token_s - second.arrival_s == pytest.approx(0.05 + 2 * 0.1 + 16 * 0.01)
    receiver, holder = sim.nodes["sched-01"], sim.nodes["sched-00"].scheduler.block_manager
    assert (receiver.pulls, receiver.pulled_blocks, receiver.scheduler.block_manager.counters.hits) == (1, 2, 32)
    assert all(block.ref_count == 0 for block in holder.blocks)
    assert sim.index.matches(second.block_hashes, set(sim.nodes)) == {"sched-00": 2, "sched-01": 3}


def test_pulls_from_one_holder_queue_on_its_link():
    profile = replace(SECONDS_PER_PREFILL_TOKEN, kv_block_bytes=1000, kv_pull_bytes_per_s=10_000,
                      kv_pull_latency_s=0.0)
    sim = ClusterSim(2, profile, PullFromFirst())
    prefix = list(range(100, 132))
    done = sim.run([SimRequest("a", 0.0, prefix + [1], 1), SimRequest("b", 10.0, prefix + [2], 1),
                    SimRequest("c", 10.0, prefix + [3], 1)])
    assert [r.first_token_s - r.arrival_s for r in done[1:]] == pytest.approx([0.2, 0.4])   # one-token prefills: free


def test_a_pull_installs_its_blocks_as_the_real_puller_does_reserve_then_adopt_chunk_by_chunk():
    receiver = BlockManager(num_blocks=4, block_size=BLOCK_SIZE, root_hash=0)
    receiver.adopt(receiver.reserve(1), [11])                 # hash 11 already cached, free
    written = install(receiver, [11, 12, 13], block_bytes=CHUNK_BYTES // 2)   # two blocks a chunk
    assert written == 3                                       # the cached hash took a block too, freed plain
    assert set(receiver.cached) == {11, 12, 13} and receiver.num_free_blocks == 4
    busy = BlockManager(num_blocks=4, block_size=BLOCK_SIZE, root_hash=0)
    busy.reserve(2)                                           # held by running requests
    assert install(busy, [1, 2, 3, 4], block_bytes=CHUNK_BYTES // 2) == 4   # the second chunk evicts the first
    assert set(busy.cached) == {3, 4}
    assert install(busy, [5, 6, 7], block_bytes=CHUNK_BYTES // 3) == 0     # a chunk the pool has no room for


def test_closed_loop_clients_send_the_next_request_as_one_ends():
    sim = one_scheduler()
    done = sim.run([SimRequest(f"r{i}", 0.0, list(range(100 + 40 * i, 132 + 40 * i)), tokens)
                    for i, tokens in enumerate((1, 3, 2, 1))], in_flight=2)
    assert [r.arrival_s for r in done] == [0.0, 0.0, 1.0, 4.0]   # r2 when r0 ends, r3 when r1 and r2 do
    assert [r.finished_s for r in done] == [1.0, 4.0, 4.0, 5.0]  # (r1 came while r0's step ran: it waited for one)


def test_ferry_bench_cluster_compares_pull_and_no_pull_with_closed_loop_clients():
    requests = workloads.load("tenants", num_requests=200)
    runs = {policy: run_one(RunSpec(4, policy, 0.0, "cpu", kv_blocks=1024, in_flight_per_scheduler=8), requests)
            for policy in ("cache_aware_no_pull", "cache_aware")}
    assert all(r["completed"] == 200 and r["in_flight"] == 32 for r in runs.values())
    assert runs["cache_aware_no_pull"]["pulls"] == 0 < runs["cache_aware"]["pulls"]


def test_a_pd_hand_off_costs_the_prefill_there_the_transfer_of_its_full_blocks_and_the_rest_on_decode():
    profile = replace(SECONDS_PER_PREFILL_TOKEN, kv_block_bytes=1000, kv_pull_bytes_per_s=10_000,
                      kv_pull_latency_s=0.05)                 # 0.1 s a block after 0.05 s to set up
    sim = DisaggregatedSim(1, 2, profile, POLICIES["round_robin"]())
    prompt = list(range(100, 153))                            # three full blocks and 5 tokens
    first, second = sim.run([SimRequest("a", 0.0, prompt, 2), SimRequest("b", 10.0, prompt[:48] + [7] * 5, 2)])
    assert first.scheduler_id == second.scheduler_id == "sched-01"
    assert first.first_token_s == pytest.approx(53 * 0.01 + 0.05 + 3 * 0.1 + 5 * 0.01)
    # the second finds its three blocks cached on both sides: it prefills 5 tokens there, nothing moves, 5 here
    assert second.first_token_s - second.arrival_s == pytest.approx(5 * 0.01 + 5 * 0.01)
    assert (sim.stats.prefills, sim.stats.transfers, sim.stats.transferred_blocks) == (2, 1, 3)
    assert sim.stats.transfer_s == pytest.approx([0.35, 0.0])
    prefill, decode = sim.nodes["sched-00"].scheduler.block_manager, sim.nodes["sched-01"].scheduler.block_manager
    assert (prefill.counters.hits, decode.counters.hits) == (48, 96)
    assert all(block.ref_count == 0 for block in prefill.blocks)
    assert first.num_output_tokens == 2 and sim.handoffs == {}


def long_prefills_among_decodes() -> list[SimRequest]:
    """Long-output chats, and every 0.5 s a long prompt arriving while they decode."""
    chats = [SimRequest(f"c{i}", 0.0, list(range(1000 * i, 1000 * i + 20)), 500) for i in range(4)]
    documents = [SimRequest(f"d{i}", 0.5 * i, list(range(50_000 + 4000 * i, 53_000 + 4000 * i)), 2)
                 for i in range(1, 6)]
    return chats + documents


def test_pd_keeps_long_prefills_out_of_the_decode_steps_at_the_price_of_the_first_token():
    profile = replace(PROFILES["h100_llama8b"], max_num_batched_tokens=512)
    colocated = one_scheduler(profile, "least_loaded", num_schedulers=2)
    disaggregated = DisaggregatedSim(1, 2, profile, POLICIES["least_loaded"]())
    runs = {name: sim.run(long_prefills_among_decodes()) for name, sim in (("co", colocated),
                                                                             ("pd", disaggregated))}
    worst_gap = {name: max(gap for r in done[:4] for gap in r.token_gaps) for name, done in runs.items()}
    decode_step = profile.fixed_s + 4 * profile.decode_seq_s
    assert worst_gap["co"] > 512 * profile.prefill_token_s > 2 * decode_step > worst_gap["pd"]
    ttft = {name: max(r.first_token_s - r.arrival_s for r in done[4:]) for name, done in runs.items()}
    assert ttft["pd"] > ttft["co"]     # the documents' prefills share one scheduler, then move
    assert disaggregated.stats.transferred_blocks == 4 * 1 + 5 * ((3000 - 1) // BLOCK_SIZE)   # all but the last token


def test_ferry_bench_cluster_compares_pd_splits_with_co_located_serving():
    requests = long_mix(40, long_fraction=0.3)
    runs = [run_one(RunSpec(4, "cache_aware", 2.0, "h100_llama8b", prefill_schedulers=p), requests) for p in (0, 1)]
    assert [r["completed"] for r in runs] == [40, 40]
    colocated, disaggregated = runs
    assert disaggregated["itl_s"]["max"] < 0.05 < 0.1 < colocated["itl_s"]["max"]   # no 3k-6k-token prefill beside
    assert disaggregated["disaggregation"]["transfers"] == 40 and colocated["pulls"] == 0
    assert disaggregated["tpot_s"] is not None and "disaggregation" not in colocated
    assert prefill_count("1:3", 16) == 4 and prefill_count("1:1", 64) == 32 and prefill_count("5", 16) == 5


def test_tenants_file_writes_the_shape_asked_with_ids_folded_into_the_vocabulary(tmp_path):
    out = tmp_path / "t.json"
    tenants_file(["--num-tenants", "4", "--prefix-tokens", "32,48", "--max-tokens", "2,3", "--num-requests", "20",
                  "--vocab-size", "100", "--out", str(out)])
    requests = workloads.load_workload_file(out)
    assert len(requests) == 20 and all(2 <= r.max_tokens <= 3 for r in requests)
    assert all(3 <= t < 100 for r in requests for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids[:32]) for r in requests}) <= 4
