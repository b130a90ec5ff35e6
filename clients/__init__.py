"""Client side of fl-attack: a ClientApp training by FedSGD, FedAvg or DP-SGD."""
