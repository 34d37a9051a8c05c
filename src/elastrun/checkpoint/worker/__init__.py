"""The workers' side of memory checkpoints (torch): the DCP storage layer
(``storage``, with ``metadata`` and ``steps``), the size check (``space``) and the
convenience form (``memory``). It never imports the agent's side."""
