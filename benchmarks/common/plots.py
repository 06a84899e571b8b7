"""PNG figures for BENCHMARKS.md."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


@contextmanager
def figure(path: Path, *grid: int, **subplots) -> Iterator:
    """The axes of a new figure (plt.subplots(*grid, **subplots)), laid out and saved to path once drawn."""
    plt = pyplot()
    fig, axes = plt.subplots(*grid, **subplots)
    yield axes
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def kv_occupancy(traces, path: Path) -> None:
    with figure(path, 1, len(traces), figsize=(6 * len(traces), 4), sharey=True) as axes:
        for ax, trace in zip(axes, traces):
            ax.plot(trace.kv_usage, label="pool blocks in use")
            ax.plot(trace.slot_fill, label="reserved slots holding tokens")
            ax.set_title(f"{trace.layout} KV: up to {max(trace.running, default=0)} sequences at once")
            ax.set_xlabel("step")
            ax.set_ylim(0, 1.05)
            ax.legend(loc="lower right")


def throughput_vs_rate(results: list[tuple[float, dict]], path: Path) -> None:
    labels = [("inf" if r == float("inf") else f"{r:g}") for r, _ in results]
    with figure(path, figsize=(6, 4)) as ax:
        ax.plot(labels, [res["output_tokens_per_s"] for _, res in results], marker="o")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("output tokens/s")


def ttft_distribution(ttfts: list[float], path: Path) -> None:
    with figure(path, figsize=(6, 4)) as ax:
        ax.hist(ttfts, bins=30)
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("requests")


def cluster_sweep(runs: list[dict], path: Path) -> None:
    """Per cluster size: output tok/s and p90 TTFT against the request rate, one line per policy."""
    sizes = sorted({r["num_schedulers"] for r in runs})
    with figure(path, 2, len(sizes), figsize=(6 * len(sizes), 8), squeeze=False) as axes:
        for column, size in enumerate(sizes):
            for policy in dict.fromkeys(r["policy"] for r in runs):
                points = sorted((r["request_rate"], r) for r in runs if r["num_schedulers"] == size
                                and r["policy"] == policy and r["ttft_s"])
                rates = [rate for rate, _ in points]
                axes[0][column].plot(rates, [r["output_tokens_per_s"] for _, r in points], marker="o", label=policy)
                axes[1][column].plot(rates, [r["ttft_s"]["p90"] for _, r in points], marker="o", label=policy)
            axes[0][column].set_title(f"{size} schedulers")
            axes[0][column].set_ylabel("output tokens/s")
            axes[1][column].set_ylabel("TTFT p90 (s)")
            axes[1][column].set_yscale("log")
            axes[1][column].set_xlabel("request rate (req/s)")
            axes[0][column].legend()
