"""The node check: a node proves its accelerators and links before it joins a round.

Both sides of the concept live here, one subpackage each: ``agent`` (the agent's side,
composed by the agent) and ``worker`` (the check's own process, which imports torch).
"""
