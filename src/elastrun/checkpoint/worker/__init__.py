"""The workers' side of memory checkpoints (torch): the DCP storage layer, the size
check, ``MemoryCheckpoint``, its persisting to disk in DCP's own format and each rank's
report to its agent. It never imports the agent's side."""
