"""In-process recovery, the agent's side (the workers' side is the package above).

These modules are part of the agent (they import ``elastrun.agent``'s parts and are
imported by its loop) and never import the workers' side, nor torch.
"""
