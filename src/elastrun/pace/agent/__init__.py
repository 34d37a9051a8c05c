"""Pace, the agent's side: the board the workers report into, the pure detectors (hangs,
stragglers, restarts without progress) and the watches that turn their snapshots into
verdicts, metrics and events. It never imports torch nor the workers' side
(``elastrun.pace.worker``); the two share :mod:`elastrun.wire.progress`.
"""
