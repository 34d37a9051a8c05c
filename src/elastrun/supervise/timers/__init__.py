"""The agent's watchdogs over the workers' expiration timers (``TORCHELASTIC_*_TIMER_*``).

The workers' side is :mod:`elastrun.timer`; the two share only :mod:`elastrun.wire.timer`.
"""
