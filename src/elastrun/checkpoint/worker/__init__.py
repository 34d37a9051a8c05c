"""The workers' side of memory checkpoints (torch): the DCP storage layer
(``storage``, with ``metadata`` and ``steps``), the size check (``space``), the
convenience form (``memory``), its persisting to disk in DCP's own format
(``persist``, with ``persist_plan``) and each rank's report to its agent (``report``).
It never imports the agent's side."""
