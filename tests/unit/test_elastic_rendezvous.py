"""The agent's typed view of a rendezvous: elastrun's handler as is, others adapted."""

from __future__ import annotations

import pytest

from elastrun.rendezvous.api import RoundOutcome
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler, NodeDesc, RendezvousSettings
from elastrun.rendezvous.elastic import ElasticRendezvous, PlainRendezvous, as_elastic
from elastrun.rendezvous.local import LocalRendezvousHandler
from elastrun.store.memory import MemoryStore


def test_the_dynamic_handler_is_elastic_itself() -> None:
    settings = RendezvousSettings("job", 1, 1)
    handler = DynamicRendezvousHandler(
        MemoryStore(), settings, NodeDesc("a", "127.0.0.1", "default", 1)
    )
    rdzv = as_elastic(handler)
    assert rdzv is handler
    assert isinstance(handler, ElasticRendezvous)
    assert rdzv.observes_cancel_scope and rdzv.keeps_job_budget and rdzv.has_exit_barrier


def test_a_torch_style_handler_gets_torchruns_answers() -> None:
    handler = LocalRendezvousHandler("job")
    rdzv = as_elastic(handler)
    assert isinstance(rdzv, PlainRendezvous) and rdzv.handler is handler
    assert not (rdzv.observes_cancel_scope or rdzv.keeps_job_budget or rdzv.has_exit_barrier)
    assert rdzv.change_reason == "" and rdzv.refusal is None
    rdzv.set_node_info("trainer", 4)  # accepted and ignored
    rdzv.set_change_callback(lambda: None)
    assert rdzv.exit_barrier(5.0).outcome is RoundOutcome.SUCCEEDED
    with pytest.raises(NotImplementedError):
        rdzv.report_failure(3)
