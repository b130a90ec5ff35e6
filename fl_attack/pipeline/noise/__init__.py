"""The selection's variants for updates with DP noise (no exact zeros).

In: a candidate pool found under noise. Out: a selection whose rows are right up to the noise.
:mod:`.one_at_a_time` selects directions one by one on wide layers, :mod:`.joint_refit` re-fits
the found directions on the zeros their inputs predict, :mod:`.blend_refit` re-fits directions
that blend in other samples.
"""
