"""What clients send: the victim networks and their FedSGD, FedAvg and DP-SGD updates.

``models`` builds the victim networks and finds their attackable layers, ``gradients``
computes exact layer gradients (and the truth they hide), ``local_sgd`` is the one SGD loop
of FedSGD and FedAvg, ``victims`` turns these into the updates a server observes (and
re-exports the rest), ``training`` is a Flower client's local training over its dataset
indices, and ``opacus_keys`` is the one rule for Opacus' ``_module.`` key prefix.
"""
