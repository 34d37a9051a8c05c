"""The agent's side of memory checkpoints: the node's directory, made before the first
workers start and removed when the run ends (``node_dir``), the workers' reports in
it, turned into events and metrics (``reports``), and the copies that make them outlive
the node: what a node holds and the decisions made from it (``holdings``), the
directory served to the other agents (``serve``) and the part that copies a buddy's
steps and gathers what a round's ranks need (``buddy``, with its copying thread in
``copier``). No torch."""
