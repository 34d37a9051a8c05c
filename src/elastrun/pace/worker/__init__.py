"""Pace, the workers' side: :mod:`.report`, the step counter behind ``elastrun.progress``.

It imports nothing of the agent's side (``elastrun.pace.agent``); this ``__init__``
imports nothing, so a worker that never reports loads nothing of it.
"""
