"""The node check: a node proves its accelerators and links before it joins a round.

Both sides of the concept live here, and each module belongs to one of them:

- the agent's side: ``check`` (when to check this node, running the check's processes,
  keeping a bad node out), part of the agent;
- the rendezvous's side: ``verdicts`` (the rule, the pairing of nodes into link
  rounds and the verdicts, pure) and ``board`` (where the nodes' checks meet in the
  rendezvous store);
- the check's own process: ``runner`` (``python -m elastrun.nodecheck.runner``: the
  compute part and the link part, which import torch; nothing of the agent).
"""
