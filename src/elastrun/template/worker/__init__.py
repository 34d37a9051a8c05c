"""The worker template, the template's side (the two sides: :mod:`elastrun.template`).

This ``__init__`` imports nothing, so the template stays as small as its modules.
"""
