"""The agent's side of memory checkpoints: the node's directory, made before the first
workers start and removed when the run ends (``node_dir``), and the workers' reports in
it, turned into events and metrics (``reports``). No torch."""
