"""PNG charts of the results (matplotlib, headless): launch, rendezvous and the workers'
bootstrap store against N, every launcher, implementation or server on the same axes."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Series = Mapping[str, Mapping[str, list[float]]]  # name -> N (as text) -> samples

STYLE = {
    "torchrun": ("tab:red", "s"),
    "torch-c10d": ("tab:red", "s"),
    "elastrun": ("tab:blue", "o"),
    "elastrun-async": ("tab:blue", "o"),
    "elastrun-threads": ("tab:cyan", "^"),
    "elastrun --no-template": ("tab:cyan", "^"),
    "bare spawn": ("tab:gray", "D"),
    "torch libuv": ("tab:red", "s"),
}


def _draw(ax: Axes, series: Series) -> None:
    for name, by_n in series.items():
        points = sorted((int(n), s) for n, s in by_n.items() if s)
        if not points:
            continue
        xs = [n for n, _ in points]
        med = [statistics.median(s) for _, s in points]
        lo = [m - min(s) for m, (_, s) in zip(med, points, strict=True)]
        hi = [max(s) - m for m, (_, s) in zip(med, points, strict=True)]
        color, marker = STYLE.get(name, ("tab:gray", "x"))
        ax.errorbar(xs, med, yerr=[lo, hi], label=name, color=color, marker=marker, capsize=3)


def _panels(
    data: Mapping[str, Series],
    path: Path,
    *,
    titles: Mapping[str, str],
    xlabel: str,
    ylabels: Mapping[str, str],
    log_y: bool,
) -> bool:
    """One panel per key of ``data`` that has samples, side by side, N on a log axis;
    False (and no file) when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, s) for k, s in data.items() if any(s.values())]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (key, series) in zip(axes[0], panels, strict=True):
        _draw(ax, series)
        ax.set_title(titles.get(key, key))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabels.get(key, "seconds (median, min-max)"))
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        else:
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_launch(data: Mapping[str, Series], path: Path) -> bool:
    """`data`: workload ("trivial", "torch") -> launcher -> N -> seconds."""
    titles = {
        "trivial": "trivial workers: invoke → all running",
        "torch": "torch workers: invoke → all in the gloo group",
    }
    return _panels(data, path, titles=titles, xlabel="workers (N)", ylabels={}, log_y=False)


def plot_rendezvous(data: Mapping[str, Series], path: Path) -> bool:
    """`data`: "ranked" / "settle" -> implementation -> N -> seconds."""
    titles = {
        "ranked": "last join → all ranked",
        "settle": "joining phase: N-1 nodes at once → all seen",
    }
    return _panels(data, path, titles=titles, xlabel="simulated nodes (N)", ylabels={}, log_y=True)


def bootstrap_series(
    tables: list[dict[str, object]],
) -> dict[str, dict[str, dict[str, list[float]]]]:
    """From the bootstrap store section's tables (their JSON form): "burst" (seconds
    until every client passed the barrier) and "get" (operations per second), each
    server -> clients (as text) -> samples."""
    wanted = {"burst": ("Bootstrap burst: seconds", "barrier"), "get": ("Throughput", "get")}
    out: dict[str, dict[str, dict[str, list[float]]]] = {"burst": {}, "get": {}}
    for table in tables:
        rows, title = table.get("rows"), str(table.get("title", ""))
        for kind, (title_start, prefix) in wanted.items():
            if not (isinstance(rows, dict) and title.startswith(title_start)):
                continue
            for key, row in rows.items():
                n = key.removeprefix(prefix)
                if key.startswith(prefix) and n.isdigit():
                    for server, samples in row["samples"].items():
                        out[kind].setdefault(server, {})[n] = list(samples)
    return out


def plot_bootstrap(data: Mapping[str, Series], path: Path) -> bool:
    """`data`: "burst" / "get" -> server -> clients -> seconds / operations per second."""
    titles = {
        "burst": "burst: all connect → id read → barrier passed",
        "get": "throughput: get",
    }
    named = {
        key: {("torch libuv" if s == "torch" else s): v for s, v in series.items()}
        for key, series in data.items()
    }
    ylabels = {"get": "operations per second"}
    return _panels(named, path, titles=titles, xlabel="clients (N)", ylabels=ylabels, log_y=True)
