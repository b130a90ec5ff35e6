"""Tabular data for the victims' clients: the UCI Adult census data set (public names).

SPEAR (Table 2) and Tableak attack clients that train on UCI Adult ("census income"): 14
features of a person, the label being whether the yearly income exceeds 50K USD. Every discrete
feature is one-hot encoded (one column per category, in the order of ``adult.names``), every
continuous feature standardized with the mean and standard deviation of the training split.
(Tableak's code goes one step further and standardizes the one-hot columns too, with train +
test statistics; an exact attack recovers either encoding alike.)
The attack recovers the encoded rows; :func:`decode_batch` maps them back to records (argmax
per one-hot group, de-standardized continuous values) and :func:`score_reconstruction`
scores them as SPEAR Table 2 does: discrete-feature accuracy (%) and continuous mean absolute
error in the features' original units, after a one-to-one matching of reconstructed rows to
true rows.

This module gathers the public names of :mod:`fl_attack.data.tabular_schema` (the encoding),
:mod:`fl_attack.data.tabular_data` (data in memory, batches, scores) and
:mod:`fl_attack.data.adult` (the UCI files).
"""

from __future__ import annotations

from fl_attack.data.adult import (
    ADULT_CLASSES,
    ADULT_FEATURES,
    ADULT_FILES,
    MISSING,
    adult_search_paths,
    load_adult,
)
from fl_attack.data.tabular_data import TabularData, TabularScore, sample_tabular_batch, score_reconstruction
from fl_attack.data.tabular_schema import (
    CONTINUOUS,
    DISCRETE,
    DecodedBatch,
    Record,
    TabularFeature,
    TabularSchema,
    decode_batch,
)

__all__ = [
    "ADULT_CLASSES",
    "ADULT_FEATURES",
    "ADULT_FILES",
    "CONTINUOUS",
    "DISCRETE",
    "MISSING",
    "DecodedBatch",
    "Record",
    "TabularData",
    "TabularFeature",
    "TabularSchema",
    "TabularScore",
    "adult_search_paths",
    "decode_batch",
    "load_adult",
    "sample_tabular_batch",
    "score_reconstruction",
]
