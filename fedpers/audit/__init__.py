"""The audit as a library: an empirical lower bound on a run's ε from canary users scored on what the
run published (docs/audit.md); ``fedpers audit`` (:mod:`fedpers.commands.audit`) is its command.

:mod:`.canaries` the placements beyond a design's own (the designs are each algorithm's
``canary_design`` hook), :mod:`.published` published runs on the local runtime, the Flower runtime and
the nodes' own mechanism, :mod:`.scores` the scorer and the proven ε the bounds stand beside,
:mod:`.bounds` the lower bounds themselves, :mod:`.run` the audit that ties them together."""

from fedpers.audit.canaries import PLACEMENTS, audited_algorithms, paired_canaries
from fedpers.audit.published import (
    Published,
    PublishingPrivatizer,
    node_side_plan,
    run_published,
    run_published_flower,
    run_published_nodes,
)
from fedpers.audit.run import audit, audit_configuration
from fedpers.audit.scores import CanaryScores, canary_scores, in_role_scores, null_scores, score_canaries

__all__ = [
    "PLACEMENTS",
    "CanaryScores",
    "Published",
    "PublishingPrivatizer",
    "audit",
    "audit_configuration",
    "audited_algorithms",
    "canary_scores",
    "in_role_scores",
    "node_side_plan",
    "null_scores",
    "paired_canaries",
    "run_published",
    "run_published_flower",
    "run_published_nodes",
    "score_canaries",
]
