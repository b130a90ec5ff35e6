"""Updates from several local steps (FedAvg): ReLU patterns that change during training.

In: an update ``W_T - W_0`` and what is known of the client's training (steps, epochs,
learning rate, momentum, weight decay). Out: matching, proposals and self-checks for it.
Full-batch local steps: :mod:`.drift`, :mod:`.drift_proposals`. Mini-batch epochs:
:mod:`.local_epochs`, :mod:`.epoch_scorer`; the bound that refuses before the search:
:mod:`.epoch_reach`. How steps combine: :mod:`.sgd_schedule`;
weight decay's share: :mod:`.weight_decay`.
"""
