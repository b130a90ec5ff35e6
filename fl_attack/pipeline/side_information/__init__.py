"""Side information: what the model's shape tells, turned into more candidate directions.

In: the factors and what the attack was given besides the layer's update. Out: candidate
directions for the same pool as the search. Non-negative inputs (:mod:`.input_cone`,
:mod:`.input_rounds`, :mod:`.missing_samples`), one-hot columns (:mod:`.onehot_groups`,
:mod:`.onehot_rows`, :mod:`.onehot_rounds`), an output layer right after the attacked layer
(:mod:`.output_layer`, :mod:`.binary_head`), and the next layer's update (:mod:`.next_layer`).
"""
