"""The stages of the exact attacks, one sub-package each, in the order they run.

- :mod:`~fl_attack.pipeline.spectrum`: from the observed weight update to its low-rank factors
  and the batch size b (the singular-value gap).
- :mod:`~fl_attack.pipeline.search`: from the factors to a pool of candidate directions, each a
  sample's column of the output gradient with exact zeros (SPEAR++'s search on the sphere,
  SPEAR's sampling, mixtures split, the last directions scanned).
- :mod:`~fl_attack.pipeline.side_information`: more candidates from what the model's shape tells
  (non-negative inputs, one-hot columns, the output or the next layer's update).
- :mod:`~fl_attack.pipeline.selection`: from the pool to b directions that explain the update, the
  scale that turns them into the layer's inputs, and the attack's own check of the result.
- :mod:`~fl_attack.pipeline.noise`: the selection's variants for updates with DP noise.
- :mod:`~fl_attack.pipeline.local_training`: matching and checks for FedAvg's local steps and
  epochs (ReLU patterns that change during training, momentum, weight decay).
- :mod:`~fl_attack.pipeline.budget`: the attack's time budget, shared by every stage.

The sub-packages import nothing on their own; import the module that holds what you need.
"""
