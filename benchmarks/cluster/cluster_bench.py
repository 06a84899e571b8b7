"""`ferry bench cluster`: every routing policy at several Poisson request rates on a simulated cluster of N real
schedulers (benchmarks/cluster/cluster_sim.py). Reports per policy and rate: output tok/s, TTFT p50/p90/p99, prefix
hit rate (prefix-cache hit tokens / looked-up prompt tokens, the schedulers' own counters) and load imbalance (the
busiest scheduler's busy time over the mean). Rates are given per scheduler, so one command compares cluster
sizes at the same load per scheduler; the report also gives the cluster's rate.

With `--adapters A` every request names one of A LoRA adapters (Zipf-popular, `--adapter-zipf-s`), each scheduler
holds `--max-loras` of them resident at once and pays `--lora-load-s` to load another; the report adds the adapter
loads, and the policy `adapter_blind` (cache_aware with adapter residency ignored) is the baseline of adapter-aware
routing. The issue 36 figure: `--adapters 64 --num-schedulers 16 --policies round_robin,adapter_blind,cache_aware`.

cache_aware may send a request to a less loaded scheduler that pulls the prompt's cached prefix from its holder
(issue 42; the router's --kv-pull-cost is set from the profile's link and prefill cost, sim_kv_pull.py);
`cache_aware_no_pull` is the router with --no-kv-pull. `--in-flight-per-scheduler K` replaces the Poisson rates by
closed-loop clients: K x N requests in flight, each client sending its next request as its last one ends.

`--prefill-schedulers` runs disaggregated prefill and decode beside co-located serving (benchmarks/cluster/
sim_disagg.py): of the N schedulers, P only prefill and the rest decode, routed by the policy; each item is 0
(co-located), a count P, or a split "P:D" of N (1:3 of 16: 4 prefill, 12 decode). The report adds inter-token
latency (ITL: the gaps between a request's output tokens, all requests' together) and TPOT (a request's mean gap),
the figures disaggregation is for, and per P/D run the prompts' transfers from prefill to decode schedulers.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.cluster.cluster_sim import BLOCK_SIZE, ClusterSim, SimRequest
from benchmarks.cluster.cost_model import load_profile
from benchmarks.cluster.sim_adapters import DEFAULT_MAX_LORAS, AdapterSetup
from benchmarks.cluster.sim_disagg import PREFILL_PICKS, DisaggregatedSim
from benchmarks.cluster.sim_kv_pull import pull_cost_fraction
from benchmarks.common.cli_args import add_workload_args, bench_parser, load_requests, report
from benchmarks.common.routing_workloads import adapter_names, adapter_picks
from benchmarks.common.workloads import BenchRequest
from router.kv_pull import KvPullOptions
from router.policy import POLICIES, CacheAwarePolicy, RoutingPolicy
from scheduler.presence import EVENTS_FLUSH_INTERVAL_S

TTFT_TARGET_S = 2.0
REGISTRATION_READ_S = 0.5   # router/discovery.py's refresh_seconds in `ferry up`
# the scheduler's publishing task: its gathering of a step's events, a turn of its event loop and one Redis write
KV_EVENT_LAG_S = EVENTS_FLUSH_INTERVAL_S + 0.002
BENCH_POLICIES = {**POLICIES, "adapter_blind": lambda: CacheAwarePolicy(adapter_load_tokens=0),
                  "cache_aware_no_pull": lambda: CacheAwarePolicy(kv_pull=KvPullOptions(kv_pull=False))}
"""The router's policies; cache_aware blind to where adapters are resident (the baseline of adapter affinity), and
cache_aware that never pulls a prefix from its holder (--no-kv-pull)."""


@dataclass(frozen=True)
class RunSpec:
    num_schedulers: int
    policy: str
    rate_per_scheduler: float
    profile: str
    kv_blocks: int = 0
    seed: int = 0
    num_routers: int = 1
    heartbeat_s: float = 1.0             # how often the schedulers publish their load (ttl / 3 in `ferry up`)
    announce_prompts: bool = False       # the schedulers' --announce-prompts
    num_adapters: int = 0                # LoRA adapters the requests name (0: the base model only)
    adapter_zipf_s: float = 1.1          # their popularity (0: uniform)
    max_loras: int = DEFAULT_MAX_LORAS   # adapters resident at once on a scheduler
    lora_load_s: float | None = None     # seconds to make one resident (None: the profile's)
    in_flight_per_scheduler: int = 0     # closed-loop clients per scheduler (0: Poisson arrivals at the rate)
    holder_margin: float | None = None   # cache_aware's (None: the router's default)
    timing_noise: float = 0.0            # steps this fraction longer or shorter at random, heartbeats at a random phase
    prefill_schedulers: int = 0          # disaggregated: this many prefill schedulers, the rest decode (0: co-located)
    prefill_pick: str = "heartbeat"      # how P/D picks the prefill scheduler (sim_disagg.py; heartbeat: the router's)
    registration_read_s: float = REGISTRATION_READ_S   # how often the router reads the registrations (0: at once)
    kv_event_lag_s: float = KV_EVENT_LAG_S             # a step's end to its KV events in the prefix index

    @property
    def rate(self) -> float:
        return self.rate_per_scheduler * self.num_schedulers

    @property
    def in_flight(self) -> int:
        return self.in_flight_per_scheduler * self.num_schedulers

    def adapter_setup(self) -> AdapterSetup | None:
        if not self.num_adapters:
            return None
        load_s = load_profile(self.profile).lora_load_s if self.lora_load_s is None else self.lora_load_s
        return AdapterSetup(tuple(adapter_names(self.num_adapters)), self.max_loras, load_s)


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` requests per second, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def sim_requests(requests: list[BenchRequest], rate: float, seed: int, num_adapters: int = 0,
                 adapter_zipf_s: float = 1.1) -> list[SimRequest]:
    arrivals = poisson_arrivals(len(requests), rate, seed)
    adapters = adapter_picks(len(requests), num_adapters, adapter_zipf_s, seed) if num_adapters else [""] * len(
        requests)
    return [SimRequest(f"r{i}", float(t), list(r.prompt_token_ids), r.max_tokens, adapter)
            for i, (r, t, adapter) in enumerate(zip(requests, arrivals, adapters))]


def percentiles(values: list[float], digits: int = 3) -> dict[str, float] | None:
    if not values:
        return None
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(p50), digits), "p90": round(float(p90), digits), "p99": round(float(p99), digits)}


def token_latencies(done: list[SimRequest]) -> dict:
    """ITL: every gap between consecutive output tokens, of all requests (with p99.9 and the longest: a long
    prefill stalls the few rows decoding beside it, rare among all gaps); TPOT: each request's mean gap."""
    gaps = [gap for r in done for gap in r.token_gaps]
    tpot = [(r.finished_s - r.first_token_s) / (r.num_output_tokens - 1) for r in done if r.num_output_tokens > 1]
    itl = percentiles(gaps, 4)
    if itl:
        itl.update({"p99.9": round(float(np.percentile(gaps, 99.9)), 4), "max": round(max(gaps), 4)})
    return {"itl_s": itl, "tpot_s": percentiles(tpot, 4)}


def hit_rate(nodes: list) -> float | None:
    counters = [n.scheduler.block_manager.counters for n in nodes]
    queries, hits = sum(c.queries for c in counters), sum(c.hits for c in counters)
    return round(hits / queries, 4) if queries else None


def disaggregation_summary(spec: RunSpec, sim: ClusterSim, span: float) -> dict:
    """P/D: the split, how the prompts reached the decode schedulers, and the hit rate of each side (a decode
    scheduler counts the blocks it pulled as hits: the prefill side's rate is the one that saves compute)."""
    if not isinstance(sim, DisaggregatedSim):
        return {}
    stats, profile = sim.stats, load_profile(spec.profile)
    return {"prefills": stats.prefills, "recomputed_on_decode": stats.recomputed, "transfers": stats.transfers,
            "transferred_blocks": stats.transferred_blocks,
            "transferred_gb": round(stats.transferred_blocks * profile.kv_block_bytes / 1e9, 3),
            "prefill_s": percentiles(stats.prefill_s, 4), "handoff_s": percentiles(stats.transfer_s, 4),
            "prefill_hit_rate": hit_rate(sim.role_nodes("prefill")),
            "decode_hit_rate": hit_rate(sim.role_nodes("decode")),
            "prefill_busy": busy_fraction(sim.role_nodes("prefill"), span),
            "decode_busy": busy_fraction(sim.role_nodes("decode"), span)}


def busy_fraction(nodes: list, span: float) -> float | None:
    """The mean share of the run these schedulers spent in steps."""
    return round(sum(n.busy_s for n in nodes) / (len(nodes) * span), 3) if span and nodes else None


def summarize(spec: RunSpec, sim: ClusterSim, requests: list[SimRequest]) -> dict:
    done = [r for r in requests if r.finished_s is not None]
    span = max((r.finished_s for r in done), default=0.0) - min(r.arrival_s for r in requests)
    busy = [n.busy_s for n in sim.nodes.values()]
    return {"num_schedulers": spec.num_schedulers, "num_routers": spec.num_routers, "heartbeat_s": spec.heartbeat_s,
            "announce_prompts": spec.announce_prompts, "policy": spec.policy, "profile": spec.profile,
            "registration_read_s": spec.registration_read_s, "kv_event_lag_s": spec.kv_event_lag_s,
            "rate_per_scheduler": spec.rate_per_scheduler, "request_rate": round(spec.rate, 3),
            "in_flight": spec.in_flight, "prefill_schedulers": spec.prefill_schedulers,
            "pulls": sum(n.pulls for n in sim.nodes.values()),
            "pulled_blocks": sum(n.pulled_blocks for n in sim.nodes.values()),
            "completed": len(done), "rejected": sum(r.rejected for r in requests),
            "unfinished": len(requests) - len(done) - sum(r.rejected for r in requests),
            "output_tokens_per_s": round(sum(r.num_output_tokens for r in done) / span, 1) if span else 0.0,
            "ttft_s": percentiles([r.first_token_s - r.arrival_s for r in done]), **token_latencies(done),
            "hit_rate": hit_rate(list(sim.nodes.values())),
            "imbalance": round(max(busy) / (sum(busy) / len(busy)), 3) if sum(busy) else None,
            "simulated_s": round(span, 2), **adapter_summary(spec, sim),
            **({"disaggregation": disaggregation_summary(spec, sim, span), "prefill_pick": spec.prefill_pick}
               if spec.prefill_schedulers else {})}


def adapter_summary(spec: RunSpec, sim: ClusterSim) -> dict:
    """With adapters: the set-up, and how many times an adapter was made resident (loads) or a request waited for a
    slot because every slot held an adapter some running request needed."""
    if sim.adapters is None:
        return {}
    return {"adapters": spec.num_adapters, "adapter_zipf_s": spec.adapter_zipf_s, "max_loras": spec.max_loras,
            "lora_load_s": sim.adapters.load_s, "adapter_loads": sum(n.adapter_loads for n in sim.nodes.values()),
            "slot_waits": sum(n.slot_waits for n in sim.nodes.values())}


def router_policies(spec: RunSpec) -> list[RoutingPolicy]:
    """One policy instance per router replica, each built as `python -m router` builds its own; cache_aware's
    window of routed work the schedulers' load cannot show yet is one heartbeat, as in the router."""
    factory = BENCH_POLICIES[spec.policy]
    policies = [factory(spec.seed + i) if spec.policy == "random" else factory(i) if spec.policy == "round_robin"
                else factory() for i in range(spec.num_routers)]   # seeded: the same figures run to run
    for policy in policies:
        if isinstance(policy, CacheAwarePolicy):
            configure_cache_aware(policy, spec)
    return policies


def configure_cache_aware(policy: CacheAwarePolicy, spec: RunSpec) -> None:
    """As the router would be set up on the simulated cluster: a window of one heartbeat, a pull's cost from the
    profile's link and prefill cost, the margin the spec names."""
    policy.recent_window_s = spec.heartbeat_s
    if policy.kv_pull.kv_pull:
        cost = pull_cost_fraction(load_profile(spec.profile), BLOCK_SIZE)
        policy.kv_pull = replace(policy.kv_pull, kv_pull_cost=round(cost, 4))
    if spec.holder_margin is not None:
        policy.holder_margin = spec.holder_margin


def new_sim(spec: RunSpec) -> ClusterSim:
    args = (spec.num_schedulers, load_profile(spec.profile), router_policies(spec), spec.kv_blocks, spec.heartbeat_s)
    kwargs = dict(announce_prompts=spec.announce_prompts, adapters=spec.adapter_setup(),
                  timing_noise=spec.timing_noise, seed=spec.seed, registration_read_s=spec.registration_read_s,
                  kv_event_lag_s=spec.kv_event_lag_s)
    if spec.prefill_schedulers:
        return DisaggregatedSim(spec.prefill_schedulers, *args, prefill_pick=spec.prefill_pick, **kwargs)
    return ClusterSim(*args, **kwargs)


def run_one(spec: RunSpec, requests: list[BenchRequest]) -> dict:
    sim = new_sim(spec)
    rate = spec.rate if not spec.in_flight else 1.0   # closed loop: the clients set the arrival times
    timeline = sim.run(sim_requests(requests, rate, spec.seed, spec.num_adapters, spec.adapter_zipf_s),
                       spec.in_flight)
    return summarize(spec, sim, timeline)


def sweep(specs: list[RunSpec], requests: list[BenchRequest]) -> list[dict]:
    runs = []
    for spec in specs:
        result = run_one(spec, requests)
        ttft = result["ttft_s"] or {"p90": float("nan")}
        loads = f", adapter loads {result['adapter_loads']}" if "adapter_loads" in result else ""
        load = f"{spec.in_flight} in flight" if spec.in_flight else f"{spec.rate:g} req/s"
        itl = result["itl_s"] or {"p90": float("nan")}
        print(f"[bench] N={spec.num_schedulers} R={spec.num_routers} {run_label(result)} {load}: "
              f"{result['output_tokens_per_s']:.1f} out tok/s, TTFT p90 {ttft['p90']:.2f}s, "
              f"ITL p90 {itl['p90'] * 1e3:.1f}ms, "
              f"hit rate {result['hit_rate']}, imbalance {result['imbalance']}, pulls {result['pulls']}{loads}",
              file=sys.stderr, flush=True)
        runs.append(result)
    return runs


def run_label(run: dict) -> str:
    """The policy, and a P/D run's split (prefill:decode schedulers)."""
    prefill = run.get("prefill_schedulers", 0)
    if not prefill:
        return run["policy"]
    pick = "" if run["prefill_pick"] == "heartbeat" else f" ({run['prefill_pick']})"
    return f"{run['policy']} P/D {prefill}:{run['num_schedulers'] - prefill}{pick}"


def prefill_count(item: str, num_schedulers: int) -> int:
    """A --prefill-schedulers item for N schedulers: 0 (co-located), a count, or a split "P:D" of N."""
    if ":" not in item:
        return int(item)
    prefill, decode = (float(x) for x in item.split(":"))
    return min(num_schedulers - 1, max(1, round(num_schedulers * prefill / (prefill + decode))))


def comparison_rate(runs: list[dict], num_schedulers: int) -> float | None:
    """The lowest rate at which round_robin's p90 TTFT passes the target (2 s)."""
    rates = sorted(r["request_rate"] for r in runs if r["num_schedulers"] == num_schedulers
                   and r["policy"] == "round_robin" and r["ttft_s"] and r["ttft_s"]["p90"] > TTFT_TARGET_S)
    return rates[0] if rates else None


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def claims(runs: list[dict]) -> dict:
    """The routing targets, per cluster size: at round_robin's 2 s rate, cache_aware vs round_robin;
    at every rate, cache_aware vs least_loaded. Co-located runs only."""
    runs = [r for r in runs if not r.get("prefill_schedulers")]
    by_key = {(r["num_schedulers"], r["policy"], r["request_rate"]): r for r in runs}
    out = {}
    for n in sorted({r["num_schedulers"] for r in runs}):
        result: dict = {"rate_where_round_robin_p90_passes_2s": comparison_rate(runs, n)}
        ca, rr = (by_key.get((n, p, result["rate_where_round_robin_p90_passes_2s"])) for p in ("cache_aware",
                                                                                               "round_robin"))
        if ca and rr and ca["ttft_s"] and rr["ttft_s"]:
            result["tok_s_cache_aware/round_robin"] = ratio(ca["output_tokens_per_s"], rr["output_tokens_per_s"])
            result["p90_ttft_round_robin/cache_aware"] = ratio(rr["ttft_s"]["p90"], ca["ttft_s"]["p90"])
        result["vs_least_loaded"] = {
            str(rate): {"tok_s": ratio(r["output_tokens_per_s"], ll["output_tokens_per_s"]),
                        "p90_ttft": ratio(r["ttft_s"]["p90"], ll["ttft_s"]["p90"]) if r["ttft_s"] and ll["ttft_s"]
                        else None}
            for (size, policy, rate), r in by_key.items() if size == n and policy == "cache_aware"
            for ll in [by_key.get((n, "least_loaded", rate))] if ll}
        adapter_affinity = adapter_claims(by_key, n)
        if adapter_affinity:
            result["adapter_blind/cache_aware"] = adapter_affinity
        out[str(n)] = result
    return out


def adapter_claims(by_key: dict[tuple, dict], num_schedulers: int) -> dict:
    """Per rate, with adapters: adapter_blind's TTFT and adapter loads over cache_aware's (above 1: affinity helps)."""
    out = {}
    for (size, policy, rate), aware in by_key.items():
        blind = by_key.get((size, "adapter_blind", rate))
        if size != num_schedulers or policy != "cache_aware" or not blind or "adapter_loads" not in aware:
            continue
        if aware["ttft_s"] and blind["ttft_s"]:
            out[str(rate)] = {"ttft_p50": ratio(blind["ttft_s"]["p50"], aware["ttft_s"]["p50"]),
                              "ttft_p90": ratio(blind["ttft_s"]["p90"], aware["ttft_s"]["p90"]),
                              "adapter_loads": ratio(blind["adapter_loads"], aware["adapter_loads"])}
    return out


def table(runs: list[dict]) -> str:
    with_adapters = any("adapter_loads" in r for r in runs)
    lines = [f"{'N':>3} {'load':>8} {'policy':<27} {'done':>6} {'out tok/s':>10} {'TTFT p50':>9} {'p90':>8} "
             f"{'p99':>8} {'ITL p50':>8} {'p90':>7} {'hit rate':>8} {'imbal':>6} {'pulls':>6}"
             + (f" {'loads':>7} {'waits':>7}" if with_adapters else "")]
    for r in runs:
        t = r["ttft_s"] or {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
        hit = f"{r['hit_rate']:.1%}" if r["hit_rate"] is not None else "-"
        load = f"{r['in_flight']} ifl" if r["in_flight"] else f"{r['request_rate']:g}"
        itl = r["itl_s"] or {"p50": float("nan"), "p90": float("nan")}
        lines.append(f"{r['num_schedulers']:>3} {load:>8} {run_label(r):<27} {r['completed']:>6} "
                     f"{r['output_tokens_per_s']:>10.1f} {t['p50']:>8.2f}s {t['p90']:>7.2f}s {t['p99']:>7.2f}s "
                     f"{itl['p50'] * 1e3:>6.1f}ms {itl['p90'] * 1e3:>5.1f}ms {hit:>8} {r['imbalance'] or 0:>6.2f} "
                     f"{r['pulls']:>6}"
                     + (f" {r['adapter_loads']:>7} {r['slot_waits']:>7}" if with_adapters else ""))
    return "\n".join(lines)


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, default=0,
                        help="LoRA adapters the requests name, one each (0: the base model only)")
    parser.add_argument("--adapter-zipf-s", type=float, default=1.1,
                        help="adapter popularity: adapter k is picked with weight 1 / (k+1)^s (0: uniform)")
    parser.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS,
                        help="adapters resident at once on a scheduler (its --max-loras)")
    parser.add_argument("--lora-load-s", type=float, default=None,
                        help="seconds to make an adapter resident (default: the profile's, cost_model.py)")


def main(argv: list[str]) -> int:
    parser = bench_parser("cluster", __doc__)
    add_workload_args(parser)
    parser.set_defaults(workload="tenants", num_requests=2000)
    parser.add_argument("--num-schedulers", default="16", help="comma list, e.g. 16,64")
    parser.add_argument("--policies", default="round_robin,random,least_loaded,approximate,cache_aware",
                        help=f"comma list of {', '.join(BENCH_POLICIES)}")
    parser.add_argument("--rates-per-scheduler", default="0.5,1,2",
                        help="Poisson req/s per scheduler, comma list (the cluster's rate is N times that)")
    parser.add_argument("--profile", default="cpu",
                        help="step cost model: cpu, h100_llama8b (benchmarks/cluster/cost_model.py) or a cost-fit "
                             "file")
    parser.add_argument("--kv-blocks", type=int, default=0, help="KV pool per scheduler in blocks of 16 "
                                                                  "(0: the profile's)")
    parser.add_argument("--seed", type=int, default=0, help="arrival times (and the random policy)")
    parser.add_argument("--num-routers", type=int, default=1, help="router replicas, each with its own policy "
                                                                   "state; arrivals go to them in turn")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="how often the schedulers publish their "
                                                                       "load (cache_aware's window follows)")
    parser.add_argument("--announce-prompts", action="store_true",
                        help="the schedulers publish a prompt's blocks when they admit it, not only once computed")
    add_adapter_args(parser)
    parser.add_argument("--in-flight-per-scheduler", default="",
                        help="closed-loop clients per scheduler, comma list; replaces the Poisson rates")
    parser.add_argument("--holder-margin", type=float, default=None,
                        help="cache_aware's margin for the prompt's deepest holder (default: the router's)")
    parser.add_argument("--timing-noise", type=float, default=0.0,
                        help="each step up to this fraction longer or shorter, heartbeats at a random phase (seeded "
                             "by --seed): run-to-run variation as on a real machine")
    parser.add_argument("--prefill-schedulers", default="0",
                        help="disaggregated prefill and decode, comma list: 0 (co-located), P prefill schedulers "
                             "of N (the rest decode), or a split P:D of N (e.g. 0,1:1,1:3)")
    parser.add_argument("--prefill-pick", default="heartbeat", choices=PREFILL_PICKS,
                        help="P/D's prefill scheduler: heartbeat, the router's rule (rank_prefill: the prompt's "
                             "deepest holder unless its queue outweighs leaving it), or in_flight, a what-if: fewest "
                             "prompt tokens in flight there, blind to where prefixes are cached")
    parser.add_argument("--registration-read-s", type=float, default=REGISTRATION_READ_S,
                        help="how often the router reads the schedulers' registrations (0: the moment a heartbeat "
                             "writes them)")
    parser.add_argument("--kv-event-lag-s", type=float, default=KV_EVENT_LAG_S,
                        help="how long a step's KV events take to reach the prefix index")
    parser.add_argument("--plot-dir", type=Path)
    args = parser.parse_args(argv)
    requests = load_requests(args)
    loads = ([(0.0, int(k)) for k in args.in_flight_per_scheduler.split(",")] if args.in_flight_per_scheduler
             else [(float(rate), 0) for rate in args.rates_per_scheduler.split(",")])
    specs = [RunSpec(int(n), policy, rate, args.profile, args.kv_blocks, args.seed, args.num_routers,
                     args.heartbeat_s, args.announce_prompts, args.adapters, args.adapter_zipf_s, args.max_loras,
                     args.lora_load_s, in_flight, args.holder_margin, args.timing_noise,
                     prefill_count(split, int(n)), args.prefill_pick, args.registration_read_s,
                     args.kv_event_lag_s)
             for n in args.num_schedulers.split(",") for rate, in_flight in loads
             for split in args.prefill_schedulers.split(",") for policy in args.policies.split(",")]
    runs = sweep(specs, requests)
    print(table(runs), file=sys.stderr, flush=True)
    if args.plot_dir:
        from benchmarks.common.plots import cluster_sweep
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        sizes = args.num_schedulers.replace(",", "-")
        cluster_sweep(runs, args.plot_dir / f"cluster_{args.workload}_{Path(args.profile).stem}_n{sizes}.png")
    report(args, {"workload": str(args.workload_file or args.workload), "num_requests": len(requests),
                  "profile": args.profile, "runs": runs, "claims": claims(runs)})
    return 0
