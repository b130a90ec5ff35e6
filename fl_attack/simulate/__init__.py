"""What clients send: the victim networks and their FedSGD, FedAvg and DP-SGD updates."""
