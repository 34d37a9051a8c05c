"""The worker template, the agent's side: the process starter that forks workers from a
template, the running templates and the agent's end of their channel.

It never imports the template's own side (``elastrun.template.worker``); the two share
:mod:`elastrun.wire.template`.
"""
