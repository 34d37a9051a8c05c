"""Every format that two processes of a job share, one module each, each versioned.

======================  ============================================================
:mod:`.timer`           the expiration timers' requests on the FIFO (torch's JSON lines)
:mod:`.inprocess`       the in-process recovery channel between an agent and its workers
:mod:`.template`        the worker template's control channel (spawn batches, ledger)
:mod:`.progress`        the shared-memory file of the workers' progress records
:mod:`.workers`         ``<attempt>/workers.json``, the pids ``elastrun stacks`` signals
:mod:`.bootstrap`       what a starter tells the worker bootstrap (SIGINT held at exec)
:mod:`.checkpoint`      the node's memory checkpoint directory: layout, ranks' markers, reports
:mod:`.env`             the names of the variables that lead a worker to its agent's services
======================  ============================================================

Both ends of each format import the module and nothing of each other: the agent side
never loads a worker's machinery, and a worker never loads the agent. So the package
imports only the standard library and :mod:`elastrun.core` (import-linter holds it to
that), never torch, and this ``__init__`` imports nothing: the worker template, which
imports :mod:`.template` before it forks, stays as small as it was.

Each module states its ``VERSION`` (an int) and where the format carries it: a key of
every message or record, a handshake, or a file header. A reader refuses a version it
does not know, with an error that names both, except where the module says otherwise.
"""
