"""A round's plan for this node (agent.planner): the round is recorded in the worker
group, and the plan is made from the round, the group's spec, the restart budget and
the workers' interpreter, with nothing waited for and nothing started."""

from __future__ import annotations

from elastrun.agent.plan import WorkerServices
from elastrun.agent.planner import RoundPlanner
from elastrun.agent.policy import LocalRestartBudget
from elastrun.agent.spec import WorkerGroup, WorkerSpec
from elastrun.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
from elastrun.rendezvous.local import LocalRendezvousHandler
from elastrun.store.memory import MemoryStore
from elastrun.supervise.processes.interpreter import WorkerInterpreter


def _planner(spec: WorkerSpec, budget: LocalRestartBudget) -> tuple[RoundPlanner, WorkerGroup]:
    group = WorkerGroup(spec)
    interpreter = WorkerInterpreter("/opt/py/bin/python", {"HOME": "/home/u", "LANG": "C"})
    handler = LocalRendezvousHandler("run-7")
    return RoundPlanner(handler, group, budget, interpreter, WorkerServices()), group


def _round(rank: int, world_size: int, number: int) -> RendezvousInfo:
    where = RendezvousStoreInfo("10.0.0.1", 29400)
    return RendezvousInfo(MemoryStore(), rank, world_size, where, round=number)


def test_the_round_is_recorded_in_the_group_and_planned_for_this_nodes_workers() -> None:
    spec = WorkerSpec(local_world_size=2, entrypoint="/bin/true", args=("${local_rank}",))
    budget = LocalRestartBudget(5)
    planner, group = _planner(spec, budget)

    plan = planner.plan(_round(rank=1, world_size=3, number=4))

    assert (group.group_rank, group.group_world_size) == (1, 3)
    assert (group.master_addr, group.master_port) == ("10.0.0.1", 29400)
    assert plan.facts.run_id == "run-7"
    assert (plan.facts.round, plan.facts.group_rank, plan.facts.group_world_size) == (4, 1, 3)
    assert (plan.facts.restart_count, plan.facts.max_restarts) == (0, 5)
    assert [w.ranks.global_rank for w in plan.workers] == [2, 3]
    assert [w.ranks.world_size for w in plan.workers] == [6, 6]
    assert plan.workers[1].argv is not None and plan.workers[1].argv[-1] == "1"


def test_the_spec_overrides_the_bootstrap_address_and_the_budget_is_read_each_round() -> None:
    spec = WorkerSpec(entrypoint="/bin/true", master_addr="node-a", master_port=1234)
    budget = LocalRestartBudget(5)
    planner, group = _planner(spec, budget)
    planner.plan(_round(rank=0, world_size=1, number=0))
    assert budget.try_consume()

    plan = planner.plan(_round(rank=0, world_size=1, number=1))

    assert (group.master_addr, group.master_port) == ("node-a", 1234)
    assert (plan.facts.master_addr, plan.facts.master_port) == ("node-a", 1234)
    assert plan.facts.restart_count == 1
    assert "group_rank=0" in repr(planner) and "run-7" in repr(planner)
