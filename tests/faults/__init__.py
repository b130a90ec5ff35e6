"""Fault-injection tests: real full disks, file-size limits; they need root for mounts and skip otherwise."""
