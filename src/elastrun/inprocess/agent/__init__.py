"""In-process recovery, the agent's side (the workers' side is the package above).

- ``hub``: the agent's end of the channel to its workers (``elastrun.wire.inprocess``);
- ``answer``: did a peer fail? the agent's answer to a worker whose collective failed;
- ``recovery``: replacing only the failed workers and leading the others into the
  next round;
- ``round``: the round under way, from its start to its end (complete, late, given up);
- ``agree``: the nodes' agreement on an in-process round through the rendezvous store;
- ``steps``: the agent loop's in-process steps, alone or with other nodes.

These modules are part of the agent (they import ``elastrun.agent``'s parts and are
imported by its loop) and never import the workers' side, nor torch.
"""
