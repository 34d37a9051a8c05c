"""The node check: a node proves its accelerators and links before it joins a round.

Both sides of the concept live here, one subpackage each:

- ``agent`` (the agent's side, composed by the agent): ``check`` (when to check this
  node, running the check's processes, keeping a bad node out), ``verdicts`` (the rule,
  the pairing of nodes into link rounds and the verdicts, pure) and ``board`` (where
  the nodes' checks meet in the run's store, at the seat the rendezvous gives);
- ``worker`` (the check's own process): ``runner`` (``python -m
  elastrun.nodecheck.worker.runner``: the compute part and the link part, which import
  torch; nothing of the agent).
"""
