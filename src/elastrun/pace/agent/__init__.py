"""Pace, the agent's side (see :mod:`elastrun.pace`); it never imports torch nor the
workers' side, with which it shares :mod:`elastrun.wire.progress`."""
