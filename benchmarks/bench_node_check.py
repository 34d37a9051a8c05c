"""Node checks: what one node's check costs, and how fast a bad node among 1,000 is named.

Measured on this machine:

* **cost per node**: the check's own processes as the agent runs them
  (``python -m elastrun.nodecheck.worker.runner``): the compute part (the interpreter, torch's
  import, a warm-up and the timed matrix products; CUDA's start-up too where there is a
  GPU) and one link test (a serving and a connecting process exchanging 1 MiB each way 4
  times over loopback): wall time and CPU time (the processes' user + system).

Simulated (``--nodes`` agents, as the rendezvous benchmark simulates them, but only
their decisions: the pairing is ``nodecheck.agent.verdicts.Isolation``, the code every agent
runs, fed with simulated times):

* **time to name one bad node among N**: agents start spread over 2 s; the wave closes
  5 s after the first (``checkboard.WINDOW``); every node's compute part takes the cost
  measured above (a bad one: 1 s more in its timed products, the fault hook's
  ``slow:1``); each link round takes the slowest pair's test (a link test's measured
  process cost plus the exchange: 25 ms on a good link, 20x on the bad node's), plus
  three store round trips (publish, wait, read; 5 ms each, about what the rendezvous
  benchmark's store answers in at 1,000 clients). The bad node is named when the pairing
  is done. Target: within 60 s of the start, for a bad link (the harder case: it takes
  two rounds) and a slow compute part.

Run from the repository root::

    .venv/bin/python benchmarks/bench_node_check.py [--quick | --smoke]
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

from _report import Benchmark, Headline, Section, absolute_check

from elastrun.nodecheck.agent.board import WINDOW
from elastrun.nodecheck.agent.verdicts import Isolation

MODULE = [sys.executable, "-m", "elastrun.nodecheck.worker.runner", "--deadline", "120"]
#: Simulated: agents' start spread, a good link's exchange, the bad one's slowdown, and
#: one store round trip at 1,000 clients.
START_SPREAD_S = 2.0
GOOD_LINK_S = 0.025
BAD_FACTOR = 20.0
SLOW_COMPUTE_S = 1.0
STORE_RTT_S = 0.005
TARGET_S = 60.0


@dataclass(frozen=True)
class Options:
    samples: int
    nodes: tuple[int, ...]


PROFILE_OPTIONS = {
    "smoke": Options(samples=1, nodes=(100,)),
    "quick": Options(samples=3, nodes=(1000,)),
    "full": Options(samples=5, nodes=(1000, 10000)),
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _result(stdout: str) -> dict[str, object]:
    doc = json.loads(stdout.strip().splitlines()[-1])
    if not (isinstance(doc, dict) and doc.get("ok")):
        raise RuntimeError(f"the check failed: {stdout[-500:]}")
    return doc


def measure_compute() -> tuple[float, float, float]:
    """(wall s, CPU s, the timed products' s) of one compute part."""
    cpu0, t0 = _children_cpu(), time.monotonic()
    proc = subprocess.run([*MODULE, "compute"], capture_output=True, text=True, check=True)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    # arg-type: a JSON number
    return wall, cpu, float(_result(proc.stdout)["seconds"])  # type: ignore[arg-type]


def measure_link() -> tuple[float, float, float]:
    """(wall s, CPU s of both processes, the exchange's s) of one link test."""
    cpu0, t0 = _children_cpu(), time.monotonic()
    with subprocess.Popen(
        [*MODULE, "serve", "127.0.0.1"], stdout=subprocess.PIPE, text=True
    ) as server:
        assert server.stdout is not None
        port = json.loads(server.stdout.readline())["port"]
        client = subprocess.run(
            [*MODULE, "connect", "127.0.0.1", str(port)], capture_output=True, text=True, check=True
        )
        server.stdout.read()
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    # arg-type: a JSON number
    return wall, cpu, float(_result(client.stdout)["seconds"])  # type: ignore[arg-type]


@dataclass(frozen=True)
class Costs:
    """The measured costs the simulation uses (seconds)."""

    compute_wall: float  # the compute process, start to end
    compute_timed: float  # its timed products (what peers are compared on)
    link_process: float  # one link test's processes, start to end


def simulate(nodes: int, bad_part: str, costs: Costs, seed: int) -> tuple[float, int, bool]:
    """(seconds from the first agent's start to the verdict, link rounds, whether the
    bad node and only it was named) for one simulated job. A bad link is ``BAD_FACTOR``
    times slower; a bad compute part takes ``SLOW_COMPUTE_S`` more (the fault hook's
    ``slow:1``), which beats the slack whatever the device."""
    rng = random.Random(seed)
    names = [f"node{i:05d}" for i in range(nodes)]
    bad = rng.choice(names)
    starts = {n: rng.uniform(0.0, START_SPREAD_S) for n in names}
    closes = min(starts.values()) + WINDOW
    timed = {n: costs.compute_timed * rng.uniform(0.9, 1.1) for n in names}
    extra = {n: SLOW_COMPUTE_S if bad_part == "compute" and n == bad else 0.0 for n in names}
    # Each node's compute part runs from its start; round 0 waits for every node's.
    computed = max(starts[n] + costs.compute_wall + extra[n] for n in names)
    now = max(closes, computed)
    iso = Isolation(names, slowdown=3.0)
    iso.feed_compute({n: timed[n] + extra[n] for n in names})
    while not iso.done:
        link: dict[str, float] = {}
        for pair in iso.pairs:
            t = GOOD_LINK_S * rng.uniform(0.8, 1.25)
            if bad_part == "link" and bad in pair.nodes:
                t *= BAD_FACTOR
            for n in pair.nodes:
                link[n] = t
        slowest = max(link.values(), default=0.0)
        now += costs.link_process + slowest + 3 * STORE_RTT_S
        iso.feed(link)
    return now, iso.round, list(iso.bad) == [bad]


def body(section: Section, opts: Options) -> None:
    cost = section.table("Cost of one node's check (this machine)", ["elastrun"], None)
    compute_wall = cost.row("compute_wall_s", "compute part: wall (s)", fmt=".2f")
    compute_cpu = cost.row("compute_cpu_s", "compute part: CPU (s)", fmt=".2f")
    compute_timed = cost.row("compute_timed_s", "compute part: the timed products (s)")
    link_wall = cost.row("link_wall_s", "one link test: wall (s)")
    link_cpu = cost.row("link_cpu_s", "one link test: CPU, both sides (s)")
    link_timed = cost.row("link_timed_s", "one link test: the exchange (s)", fmt=".4f")
    for _ in range(opts.samples):
        wall, cpu, timed = measure_compute()
        compute_wall.add("elastrun", wall)
        compute_cpu.add("elastrun", cpu)
        compute_timed.add("elastrun", timed)
        wall, cpu, timed = measure_link()
        link_wall.add("elastrun", wall)
        link_cpu.add("elastrun", cpu)
        link_timed.add("elastrun", timed)
    costs = Costs(
        compute_wall.medians()["elastrun"],
        compute_timed.medians()["elastrun"],
        link_wall.medians()["elastrun"],
    )
    sim = section.table(
        "Simulated: one bad node among N, seconds from the start to its name", ["elastrun"], None
    )
    for n in opts.nodes:
        for part in ("link", "compute"):
            named = sim.row(
                f"named_{part}_{n}", f"N = {n}, a bad {part}: named after (s)", fmt=".1f",
                target=f"< {TARGET_S:.0f} s", check=absolute_check("elastrun", TARGET_S),
            )  # fmt: skip
            rounds = sim.row(f"rounds_{part}_{n}", f"N = {n}, a bad {part}: link rounds", fmt=".0f")
            for seed in range(opts.samples):
                at, k, right = simulate(n, part, costs, seed)
                if not right:
                    section.fail(f"N = {n}, a bad {part}", "another node or none was named")
                named.add("elastrun", at)
                rounds.add("elastrun", float(k))
            section.headlines.append(
                Headline(
                    f"node check, 1 bad {part} among {n}: named after",
                    f"{named.medians()['elastrun']:.1f} s",
                    f"< {TARGET_S:.0f} s",
                    bool(named.verdict()),
                )
            )
    section.raw["costs"] = costs.__dict__
    section.raw["gpus"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    section.notes.append(
        "The simulation replays the pairing every agent runs, with the measured costs of "
        "this machine's check processes; a bad link takes two rounds of pairs whatever N "
        "(its pair is slow, then each of the two is paired with a node that passed). The "
        "wave's 5 s window and the compute part (torch's import above all) dominate."
    )
    section.commands["cost"] = (
        "python -m elastrun.nodecheck.worker.runner compute; "
        "python -m elastrun.nodecheck.worker.runner serve 127.0.0.1 + connect 127.0.0.1 PORT"
    )


BENCHMARK = Benchmark(
    "node_check",
    "Node checks: cost per node, and a bad node among N named",
    body,
    PROFILE_OPTIONS,
    __doc__ or "",
)
run, main = BENCHMARK.run, BENCHMARK.main


if __name__ == "__main__":
    sys.exit(main())
