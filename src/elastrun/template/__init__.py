"""The worker template: workers forked from an interpreter that already imported torch.

Both sides of the concept live here, one subpackage each:

- ``agent`` (the agent's side, above the supervise layer): ``starter``
  (``TemplateStarter``, the process starter the agent uses), ``process`` (one running
  template and the agent's end of its control channel), ``key`` (which workers a
  template can serve) and ``preload`` (which commands it runs, which modules it imports
  first);
- ``worker`` (the template's side, a worker-side process started as ``python -m
  elastrun.template.worker.serve``): ``serve`` (the template's main loop), ``fork``
  (forking a batch) and ``child`` (what a forked child does to become the worker).

The two sides share only the channel's format, :mod:`elastrun.wire.template`; neither
imports the other.
"""
