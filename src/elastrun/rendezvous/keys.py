"""The store keys of one run of the dynamic rendezvous (DESIGN.md section 4): where each
record lives, and why it lives there (what is under ``ctl/`` wakes every watcher).

The keys of a run, under ``/elastrun/<run_id>/`` (``RunKeys``):

``ctl/nodes/<node>``         bound to the node's lease: the node is alive
``ctl/join/<n>/<node>``      bound to the lease: the node asks to be in round n
``ctl/failed/<n>``           the first node whose worker failed in round n, what failed,
                             and whether the job restarts
``ctl/done/<n>/<node>``      exit barrier of round n (kept when the node leaves)
``ctl/closed``               why the run ended; late agents are refused
``rounds/<n>/out/closer``    bound to a lease: the one node deciding round n
``rounds/<n>/out/closer/next``  the call to round n's quiet members: round n+1 was
                             decided (its result and rank 0's address), or waits for
                             their joins
``rounds/<n>/out/result``    the closed round: decision id, size, shape (small)
``rounds/<n>/members/<id>/<p>``  page p of that decision's members, with their group
                             ranks (a member is on the page its id hashes to)
``rounds/<n>/status``        the closer's progress (for the others' log lines)
``rounds/<n>/out/master``    MASTER_ADDR/PORT of round n, chosen by its rank 0
``rounds/<n>/inprocess/<r>``  what group rank r offers for an in-process recovery
``ctl/excluded/<node>``      bound to the lease: the node sits out a cool-down
``ctl/away/<node>``          bound to the lease: the node re-joins late or never
``strikes/<node>``           the times of the node's recent failures (``exclusion``)
``check/...``                node checks: waves, ports, results (``nodecheck.agent.board``)
``current``                  the newest closed round
``budget``                   failure restarts used by the whole job
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunKeys:
    """The store keys of one run, under ``prefix``. What running members and closers
    watch lives under ``ctl/``; bulky or chatty keys (results, pages, paces) live
    elsewhere, so that watching costs O(1) per change that matters."""

    prefix: str

    @classmethod
    def of_run(cls, run_id: str) -> RunKeys:
        return cls(f"/elastrun/{run_id}/")

    @property
    def ctl(self) -> str:
        return self.prefix + "ctl/"

    @property
    def nodes(self) -> str:
        return self.prefix + "ctl/nodes/"

    @property
    def closed(self) -> str:
        return self.prefix + "ctl/closed"

    def join_prefix(self, n: int) -> str:
        return f"{self.prefix}ctl/join/{n}/"

    def failed(self, n: int) -> str:
        return f"{self.prefix}ctl/failed/{n}"

    @property
    def excluded_prefix(self) -> str:
        return self.prefix + "ctl/excluded/"

    def excluded(self, node: str) -> str:
        return self.excluded_prefix + node

    @property
    def away_prefix(self) -> str:
        return self.prefix + "ctl/away/"

    def away(self, node: str) -> str:
        return self.away_prefix + node

    def strikes(self, node: str) -> str:
        """The times of ``node``'s recent failures. Not under ``ctl/``: no one watches it."""
        return f"{self.prefix}strikes/{node}"

    def out(self, n: int) -> str:
        return f"{self.prefix}rounds/{n}/out/"

    def result(self, n: int) -> str:
        return self.out(n) + "result"

    def closer(self, n: int) -> str:
        return self.out(n) + "closer"

    def next_call(self, n: int) -> str:
        """The call to round ``n``'s quiet members: the round after it was decided (enter
        it), or waits for their joins (``{"join": true}``), and why. Under the closer's
        claim: the one watch of the claim's prefix that a quiet member keeps sees both
        this call and the claim's end (its closer, who watches for them, is gone)."""
        return self.closer(n) + "/next"

    def status(self, n: int) -> str:
        return f"{self.prefix}rounds/{n}/status"

    def members_prefix(self, n: int, decision: str) -> str:
        return f"{self.prefix}rounds/{n}/members/{decision}/"

    def members(self, n: int, decision: str, page: int) -> str:
        return f"{self.members_prefix(n, decision)}{page}"

    def master(self, n: int) -> str:
        """MASTER_ADDR/PORT of round n. Under ``out/``: a node that reads or watches the
        result there gets the address with it once rank 0 wrote it."""
        return self.out(n) + "master"

    def pace(self, n: int) -> str:
        """Each node's step-time summary in round n, one key per node (stragglers).
        Not under ``ctl/``: rewritten every few seconds, it must wake no watcher."""
        return f"{self.prefix}rounds/{n}/pace/"

    def inprocess(self, n: int) -> str:
        """What each node of round n offers for an in-process recovery (one key per
        group rank): whether it kept its workers, their round and their listeners."""
        return f"{self.prefix}rounds/{n}/inprocess/"

    def done(self, n: int) -> str:
        """The exit barrier of round n. Under ``ctl/`` so that running members see a
        member finish before its lease goes (and do not take it for lost); not bound to
        a lease, so a node finishing later still counts a member that already left."""
        return f"{self.prefix}ctl/done/{n}/"

    @property
    def current(self) -> str:
        return self.prefix + "current"

    @property
    def budget(self) -> str:
        return self.prefix + "budget"
