"""Offline data for clients and benchmarks: images (bundled and torchvision roots) and UCI Adult."""
