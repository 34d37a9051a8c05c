"""A private network of Linux network namespaces, for tests that cut links.

``Topology`` builds one "switch" namespace holding a bridge, and one namespace per node,
each joined to the bridge by a veth pair. Every node address lives only inside those
namespaces (10.213.<subnet>.0/24): nothing in the root namespace can reach it, and a test
never tries -- every participant is started inside a node namespace with
``ip netns exec`` (which keeps the environment, so the suite's leak check still sees
the processes through ``ELASTRUN_TEST_TAG``).

Each interface is created directly inside its namespace (``ip -n SW link add ... peer
... netns NODE``), so the root namespace never holds one, not even for a moment.

``close()`` is the single teardown: it ends every process it started (SIGTERM, a grace,
SIGKILL), then every process still inside one of its namespaces -- all of them are our
descendants, since the namespaces are private -- and deletes the namespaces, which
takes the veths and the bridge with them. It never raises, so it is safe in a
``finally`` after a failed assertion.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

_counter = itertools.count()
#: Interface names are at most 15 characters; these are short and per-namespace.
_BRIDGE = "br0"
_NODE_IF = "eth0"


class NetnsUnavailable(Exception):
    """This host (or user) cannot create network namespaces; the reason is the text."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


class Topology:
    """Node namespaces on one bridge; ``partition``/``heal`` cut and restore a node's link.

    Args:
        nodes: short node names (e.g. ``["S", "A", "B"]``); node *i* gets the address
            ``10.213.<subnet>.<i + 1>``.
        subnet: third octet of the private /24 (the namespaces are private, so two
            topologies may even share it).

    Raises ``NetnsUnavailable`` when ``ip netns add`` is refused (not root, no
    CAP_SYS_ADMIN, no ``ip``); any other setup failure tears down what was built and
    raises ``RuntimeError``.
    """

    def __init__(self, nodes: Sequence[str], subnet: int = 213) -> None:
        self._tag = f"elr-{os.getpid()}-{next(_counter)}"
        self._nodes = list(nodes)
        self._subnet = subnet
        self.switch = f"{self._tag}-sw"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._files: list[IO[bytes]] = []
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` tool (iproute2) is not installed")
        probe = _ip("netns", "add", self.switch, check=False)
        if probe.returncode != 0:
            raise NetnsUnavailable(f"`ip netns add` failed: {probe.stderr.strip()}")
        self._created.append(self.switch)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", _BRIDGE, "type", "bridge")
        _ip("-n", sw, "link", "set", _BRIDGE, "up")
        for node in self._nodes:
            ns = self.ns(node)
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            port = self.port(node)
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", _NODE_IF,
                "netns", ns)  # fmt: skip
            _ip("-n", sw, "link", "set", port, "master", _BRIDGE)
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(node)}/24", "dev", _NODE_IF)
            _ip("-n", ns, "link", "set", _NODE_IF, "up")

    # -- naming ----------------------------------------------------------------------

    def ns(self, node: str) -> str:
        """The namespace of ``node``."""
        return f"{self._tag}-{node}"

    def port(self, node: str) -> str:
        """The switch-side end of ``node``'s veth (its port on the bridge)."""
        return f"p{self._nodes.index(node)}"

    def addr(self, node: str) -> str:
        """``node``'s IPv4 address; it exists only inside the topology."""
        return f"10.213.{self._subnet}.{self._nodes.index(node) + 1}"

    # -- running things inside -------------------------------------------------------

    def start(
        self,
        node: str,
        argv: Sequence[str],
        *,
        cwd: Path,
        log: Path,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``node``'s namespace, its own session, output to ``log``.

        Output goes to a file, not a pipe: nobody has to drain it while the test waits,
        and no descriptor outlives the test.
        """
        out = open(log, "wb")  # noqa: SIM115 -- closed by close(), after the process ends
        self._files.append(out)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(node), *argv],
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def run(self, node: str, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Run a short command inside ``node``'s namespace (``node`` may be the switch)."""
        ns = self.switch if node == "switch" else self.ns(node)
        return subprocess.run(
            ["ip", "netns", "exec", ns, *argv],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )

    # -- faults ------------------------------------------------------------------------

    def partition(self, node: str) -> None:
        """Cut ``node`` off: its switch port goes down. The node's own interface stays
        up and keeps its address and sockets; packets to and from it are simply lost,
        as on a failed cable or switch port, so no connection is reset."""
        _ip("-n", self.switch, "link", "set", self.port(node), "down")

    def heal(self, node: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port(node), "up")

    # -- teardown ----------------------------------------------------------------------

    def close(self, grace: float = 5.0) -> list[int]:
        """End every process started here or still inside a namespace, delete the
        namespaces. Returns the pids that needed SIGKILL. Never raises."""
        killed: list[int] = []
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _signal(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                killed.append(p.pid)
        for p in live:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel; the leak check will name it
        # Anything left inside our private namespaces descends from what we started
        # (e.g. a worker whose agent was SIGKILLed, or that agent's orphan guard, which
        # ends the workers and removes the node's checkpoint directory): a moment to end
        # on its own, then ended by pid.
        settle = time.monotonic() + 3.0
        while time.monotonic() < settle and any(self._pids_in(ns) for ns in self._created):
            time.sleep(0.05)
        for ns in self._created:
            for pid in self._pids_in(ns):
                _signal(pid, signal.SIGKILL)
                killed.append(pid)
        for ns in reversed(self._created):
            _ip("netns", "del", ns, check=False)
        self._created.clear()
        for f in self._files:
            f.close()
        self._files.clear()
        return killed

    @staticmethod
    def _pids_in(ns: str) -> list[int]:
        r = _ip("netns", "pids", ns, check=False)
        return [int(x) for x in r.stdout.split() if x.isdigit()]

    def __repr__(self) -> str:
        running = sum(1 for p in self._procs if p.poll() is None)
        return f"Topology({self._tag!r}, nodes={self._nodes}, running={running})"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pid: int, sig: int) -> None:
    # The process was started in its own session, so its group id is its pid: this
    # reaches it and any child that stayed in its group, and nothing else.
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
