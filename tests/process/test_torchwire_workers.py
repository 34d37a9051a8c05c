"""Real gloo workers bootstrap from TorchWireServer as torchrun's agent store, and the
store outlives rank 0: ranks that use it after rank 0 exited keep working."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastrun.store.torchwire import TorchWireServer

WORLD = 3

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 6.0, t
    group = dist.new_group([0, 1, 2])
    u = torch.tensor([1.0])
    dist.all_reduce(u, group=group)
    assert u.item() == 3.0, u
    dist.barrier()
    if rank == 0:
        # Rank 0 leaves at once: under torch's own scheme its store would go with it.
        dist.destroy_process_group()
        sys.exit(0)
    store = dist.distributed_c10d._get_default_store()
    peer = 3 - rank
    for i in range(20):
        store.set(f"late/{rank}/{i}", str(i))
        assert store.get(f"late/{peer}/{i}") == str(i).encode()
        time.sleep(0.01)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    """
)


@pytest.mark.torch
def test_gloo_workers_bootstrap_from_it_and_keep_using_it_after_rank_0_exits(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    server = TorchWireServer("127.0.0.1", 0)
    port = server.start()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = []
    try:
        for rank in range(WORLD):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        server.close()
    codes = [p.returncode for p in procs]
    report = "\n".join(f"rank {r}: {out}{err[-3000:]}" for r, (out, err) in enumerate(results))
    assert codes == [0] * WORLD, report
    assert [out.strip() for out, _ in results] == ["", "rank 1 done", "rank 2 done"]
    assert "Broken pipe" not in report and "sendBytes failed" not in report
