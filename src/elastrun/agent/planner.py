"""A round's plan for this node: the round recorded in the worker group, then planned
(with nothing waited for and nothing started: ``agent.rounds`` joins the round)."""

from __future__ import annotations

from elastrun.agent.plan import LaunchPlan, RoundFacts, WorkerServices, node_slots, round_plan
from elastrun.agent.policy import RestartBudget
from elastrun.agent.spec import WorkerGroup
from elastrun.rendezvous.api import RendezvousHandler, RendezvousInfo
from elastrun.supervise.processes.interpreter import WorkerInterpreter

__all__ = ["RoundPlanner"]


class RoundPlanner:
    """Plans this node's workers for each round.

    Args:
        handler: the rendezvous handler (the run's id; who serves the workers' store).
        group: the worker group the round is recorded in (its spec is what runs).
        budget: the restart budget (its counts go into every worker's environment).
        interpreter: the agent's interpreter and environment (under the workers' own).
        services: what the agent provides every worker (its variables are planned too).
    """

    def __init__(
        self,
        handler: RendezvousHandler,
        group: WorkerGroup,
        budget: RestartBudget,
        interpreter: WorkerInterpreter,
        services: WorkerServices,
    ) -> None:
        self._handler = handler
        self._group = group
        self._budget = budget
        self._interpreter = interpreter
        self._services = services

    def plan(self, info: RendezvousInfo) -> LaunchPlan:
        """Record the round ``info`` in the worker group; returns this node's plan."""
        group = self._group
        spec = group.spec
        group.group_rank = info.rank
        group.group_world_size = info.world_size
        group.store = info.store
        group.master_addr = spec.master_addr or info.bootstrap_store_info.master_addr
        group.master_port = spec.master_port or info.bootstrap_store_info.master_port
        facts = RoundFacts(
            run_id=self._handler.get_run_id(),
            round=info.round,
            group_rank=info.rank,
            group_world_size=info.world_size,
            master_addr=group.master_addr,
            master_port=group.master_port,
            restart_count=self._budget.used(),
            max_restarts=self._budget.limit,
            # The workers bootstrap from a store the agents host with elastrun's own
            # handlers: every node's workers use it; only rank 0's agent serves it.
            use_agent_store=self._handler.use_agent_store
            or self._handler.agent_hosts_bootstrap_store,
        )
        return round_plan(
            facts,
            spec,
            node_slots(info, spec.role, spec.local_world_size),
            base_env=self._interpreter.environ,
            python=self._interpreter.python,
            services=self._services,
        )

    def __repr__(self) -> str:
        return (
            f"RoundPlanner(run_id={self._handler.get_run_id()!r}, "
            f"group_rank={self._group.group_rank})"
        )
