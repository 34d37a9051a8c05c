"""The node check, the check's own process: :mod:`.runner` (the compute and link parts,
which import torch). It imports nothing of the agent's side (``elastrun.nodecheck.agent``).
"""
