"""Pace, the workers' side (see :mod:`elastrun.pace`); this ``__init__`` imports nothing,
so a worker that never reports loads nothing of it."""
