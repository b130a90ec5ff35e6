"""Client side of fl-attack: a ClientApp training by FedSGD, FedAvg or DP-SGD.

Importing the package checks the installed Flower version (:mod:`strategies.flower_version`).
"""

from strategies.flower_version import check_flower_version

check_flower_version()
