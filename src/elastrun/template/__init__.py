"""The worker template: workers forked from an interpreter that already imported torch.

Both sides of the concept live here, and each module belongs to one of them:

- the agent's side (the supervise layer): ``starter`` (``TemplateStarter``, the
  process starter the agent uses), ``process`` (one running template and the agent's
  end of its control channel), ``key`` (which workers a template can serve) and
  ``preload`` (which commands it runs, which modules it imports first);
- the template's side (a worker-side process, started as ``python -m
  elastrun.template.zygote``): ``zygote`` (the template's main loop), ``zygote_fork``
  (forking a batch) and ``zygote_worker`` (what a forked child does to become the
  worker).

The two sides share only the channel's format, :mod:`elastrun.wire.zygote`; neither
imports the other.
"""
