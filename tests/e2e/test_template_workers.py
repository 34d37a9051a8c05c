"""Workers forked from the template, through the ``elastrun`` command: each must behave
like the fresh ``python -u train.py ARGS`` that ``--no-template`` (and torchrun) starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _helpers import run, write_script

MODES = {"template": [], "no-template": ["--no-template"]}

# Prints what a rank draws with no seed, then with an explicit one; attempt 0 fails so
# that attempt 1 (a restart, forked from the same template) draws too.
SEEDS = """\
import json, os, sys
import torch
record = {
    "rank": os.environ["RANK"],
    "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
    "initial_seed": torch.initial_seed(),
    "rand": torch.rand(4).tolist(),
}
torch.manual_seed(1234)
record["seeded"] = [torch.initial_seed(), torch.rand(4).tolist()]
print("SEEDS " + json.dumps(record), flush=True)
sys.exit(1 if record["restart"] == "0" else 0)
"""
# torch.manual_seed(1234); torch.rand(4) in any fresh interpreter (CPU generator).
SEEDED_1234 = [0.028979241847991943, 0.4018985629081726, 0.25984418392181396, 0.3666413426399231]


@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
def test_every_rank_and_restart_draws_its_own_torch_random_numbers_unless_seeded(
    tmp_path: Path, mode: str
) -> None:
    script = write_script(tmp_path / "seeds.py", SEEDS)
    result = run(
        [*MODES[mode], "--nproc-per-node", "3", "--max-restarts", "1", str(script)],
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    records = [
        json.loads(line.removeprefix("SEEDS "))
        for line in result.stdout.splitlines()
        if line.startswith("SEEDS ")
    ]
    assert sorted((r["restart"], r["rank"]) for r in records) == [
        (restart, rank) for restart in "01" for rank in "012"
    ]
    # Six workers (three ranks, two attempts): six different OS-drawn seeds.
    assert len({r["initial_seed"] for r in records}) == 6, records
    assert len({tuple(r["rand"]) for r in records}) == 6, records
    # An explicit seed gives every worker exactly that seed's numbers.
    assert all(r["seeded"] == [1234, SEEDED_1234] for r in records), records
