"""In-process recovery, the workers' side: ``run`` (the recovery loop) and ``State``
(commits), what they hand the newest commit with, and the channel to the agent.

Nothing here imports the agent's side (``elastrun.inprocess.agent``); the two speak
through :mod:`elastrun.wire.inprocess`. Users import ``elastrun.inprocess``, which
re-exports the public names.
"""
