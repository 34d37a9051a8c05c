"""The node check, the agent's side: when to check this node, the check's processes, the
rule and its verdicts, and the board where the nodes' checks meet in the run's store. It
never imports torch nor the check's own process (``elastrun.nodecheck.worker``).
"""
