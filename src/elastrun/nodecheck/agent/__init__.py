"""The node check, the agent's side (see :mod:`elastrun.nodecheck`); it never imports
torch nor the check's own process (``elastrun.nodecheck.worker``)."""
