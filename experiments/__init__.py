"""Reproductions of the SPEAR / SPEAR++ tables and the Flower defense sweep (``python -m experiments``)."""
