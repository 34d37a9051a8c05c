"""The agent's side of memory checkpoints: the node's directory, made before the first
workers start and removed when the run ends, the workers' reports in it, turned into
events and metrics, and the copies that make them outlive the node. No torch."""
