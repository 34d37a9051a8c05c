"""The worker template, the template's side: the process the agent starts as ``python -m
elastrun.template.worker.serve``, and what a forked child does to become the worker.

It imports nothing of the agent's side (``elastrun.template.agent``); the two share
:mod:`elastrun.wire.template`. This ``__init__`` imports nothing, so the template stays
as small as its modules.
"""
