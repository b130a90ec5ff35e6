"""The honest-but-curious audit, free of any FL framework.

:class:`Auditor` selects the updates of a round, runs the attack on each
(:mod:`~fl_attack.audit.workers`), decides a verdict from what the server sees
(:mod:`~fl_attack.audit.verdict`), scores against ground truth when a client sent it, and
stores everything (:mod:`~fl_attack.audit.records`); its settings come in four groups
(:mod:`~fl_attack.audit.settings`). A framework adapter (Flower's: :mod:`strategies`) only
converts replies into :class:`ClientUpdate` objects.
"""

from fl_attack.audit.auditor import Auditor
from fl_attack.audit.layer import LayerKeys, LayerNotFoundError, select_layer
from fl_attack.audit.observations import ClientIdentity, ClientUpdate, GroundTruth
from fl_attack.audit.settings import AttackSettings, ExecutionSettings, SamplingSettings, SecAggSettings
from fl_attack.audit.signature import UpdateSignature, update_signature
from fl_attack.audit.verdict import Verdict, decide_verdict, not_applicable_reason
from fl_attack.audit.workers import AttackResult, make_runner

__all__ = [
    "AttackResult",
    "AttackSettings",
    "Auditor",
    "ClientIdentity",
    "ClientUpdate",
    "ExecutionSettings",
    "GroundTruth",
    "LayerKeys",
    "LayerNotFoundError",
    "SamplingSettings",
    "SecAggSettings",
    "UpdateSignature",
    "Verdict",
    "decide_verdict",
    "make_runner",
    "not_applicable_reason",
    "select_layer",
    "update_signature",
]
