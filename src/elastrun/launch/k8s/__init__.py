"""Kubernetes manifests for an elastic elastrun job (``elastrun k8s manifest``).

What it writes (multi-document YAML, to stdout or ``-o FILE``):

* with ``--store elastrun`` (the default): a Deployment of one ``elastrun store`` pod and
  a Service in front of it, the rendezvous every worker pod joins. The store is a pod of
  its own so that losing any worker, including the first, never loses the rendezvous;
* a headless Service that gives each worker pod a stable DNS name
  (``NAME-<index>.NAME``) and is the pods' ``subdomain``;
* an indexed Job of ``MAX`` worker pods, each running one elastrun agent with
  ``--nnodes MIN:MAX``: the job trains as soon as ``MIN`` pods run and grows to ``MAX``.

Choices, and why:

* Each agent's address is its pod IP (downward API), not a DNS name: a new pod's DNS
  record can lag behind the pod, and workers must reach the rank-0 pod at once.
* The run id is the Job's uid (the ``batch.kubernetes.io/controller-uid`` label), so a
  Job submitted again under the same name never meets the old run's closed rendezvous
  in a store that outlived it.
* ``--restart-policy Never`` adds a pod failure policy built on elastrun's exit statuses
  (``core.exitcodes``): 2 (bad configuration) and 93 (do not requeue: a crash loop,
  restarts without progress) fail the Job at once instead of burning the backoff limit;
  75 (replace this node) and pods evicted by a disruption (drain, preemption) do not
  count as failures: the node, not the job, is at fault, and the elastic job trains on
  with the other pods while the Job replaces that one. Counting 75 instead would let a
  few bad nodes in a long run fail the whole Job. The replacement may land on the same
  node: the agent names it, for cordoning.
"""

from __future__ import annotations

from elastrun.launch.k8s.manifest import ManifestSpec, agent_args, build_manifests
from elastrun.launch.k8s.yaml_writer import dump_yaml

__all__ = ["ManifestSpec", "agent_args", "build_manifests", "dump_yaml"]
