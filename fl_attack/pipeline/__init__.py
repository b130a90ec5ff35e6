"""The stages of the exact attacks, in the order they run.

1. :mod:`~fl_attack.pipeline.decompose`: the update's low-rank factors and the batch size
   from the singular-value gap.
2. :mod:`~fl_attack.pipeline.search`, :mod:`~fl_attack.pipeline.sparsity`,
   :mod:`~fl_attack.pipeline.candidates`, :mod:`~fl_attack.pipeline.mixtures`,
   :mod:`~fl_attack.pipeline.last_direction`: sparse directions of the output gradient
   (SPEAR++'s search on the sphere, SPEAR's sampling), polished to exact zeros and pooled;
   :mod:`~fl_attack.pipeline.input_side` adds directions from sparse non-negative inputs.
3. :mod:`~fl_attack.pipeline.select`: b directions that explain the update, pruned under noise,
   and the scale that turns them into the layer's inputs.

Given a FedAvg update's full-batch local steps, :mod:`~fl_attack.pipeline.drift` matches, polishes
and self-checks against the ReLU patterns at both ends of the local training, and
:mod:`~fl_attack.pipeline.drift_proposals` proposes the samples whose patterns drifted most.
"""
