"""Record names shared by the ClientApp's replies and the auditing server.

A training reply carries::

    RecordDict({
        ARRAYS_KEY:  ArrayRecord(...),                  # the trained model
        METRICS_KEY: MetricRecord({"num-examples": ..., "train-loss": ...}),
        AUDIT_KEY:   ConfigRecord({PARTITION_ID_KEY: ..., SAMPLE_INDICES_KEY: [...]}),
    })

The audit record is only present in simulation with ``audit-ground-truth`` on. It is a
ConfigRecord rather than part of the MetricRecord because strategies such as FedAvg
average every MetricRecord entry across clients (lists element-wise, which fails for
lists of different lengths); the auditing server removes it before aggregation.
"""

ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
CONFIG_KEY = "config"
AUDIT_KEY = "audit"

NUM_EXAMPLES_KEY = "num-examples"
PARTITION_ID_KEY = "partition-id"
SAMPLE_INDICES_KEY = "sample-indices"
TRAIN_MODE_KEY = "train-mode"
