"""Scoring reconstructions against the ground truth the attacker never sees."""
