"""The agent's watchdogs over the workers' expiration timers (``TORCHELASTIC_*_TIMER_*``).

:mod:`~elastrun.supervise.timers.file_server` reads the requests that workers write to
a FIFO and reaps a worker whose timer runs out; :mod:`~elastrun.supervise.timers.agent_timer`
is the agent's handle on it. The workers' side is :mod:`elastrun.timer`; the two share
only :mod:`elastrun.wire.timer`.
"""
