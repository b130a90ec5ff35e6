"""Names of the records an audited training reply may carry, shared by both sides.

A client's training reply always carries what the user's strategy expects (its
``ArrayRecord`` and ``MetricRecord``). For scoring only, and only where the client's own
node config enables it (``audit-ground-truth = true``; never because the server asks), it
may add::

    AUDIT_KEY:        ConfigRecord({PARTITION_ID_KEY: ..., SAMPLE_INDICES_KEY: [...], TRAIN_MODE_KEY: ...})
    GROUND_TRUTH_KEY: ArrayRecord({GROUND_TRUTH_INPUTS: (B, ...) the batch it trained on})

The audit record is a ConfigRecord rather than part of the MetricRecord because strategies
such as FedAvg average every MetricRecord entry across clients. The auditing server removes
both records before the inner strategy aggregates, so aggregation never sees them.
"""

ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
CONFIG_KEY = "config"
AUDIT_KEY = "audit"
GROUND_TRUTH_KEY = "fl-attack-ground-truth"
GROUND_TRUTH_INPUTS = "inputs"

#: Node-config key with which a client opts in to sending ground truth (simulation audits).
NODE_GROUND_TRUTH_KEY = "audit-ground-truth"

NUM_EXAMPLES_KEY = "num-examples"
PARTITION_ID_KEY = "partition-id"
SAMPLE_INDICES_KEY = "sample-indices"
TRAIN_MODE_KEY = "train-mode"

#: Legacy (``NumPyClient``) replies, e.g. under SecAgg+, reach a strategy only as ``FitRes``:
#: parameters, example count and scalar metrics. An opted-in client reports its audit fields
#: as metrics named with this prefix (sample indices as text, ``"3,17,42"``); the auditing
#: server removes them before the inner strategy aggregates.
LEGACY_METRIC_PREFIX = "fl-attack."
