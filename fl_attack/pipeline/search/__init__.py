"""The search stage: factors in, a pool of exact candidate directions out.

In: the factor ``L`` and b. Out: a :class:`~.candidates.CandidatePool` of unit vectors ``q`` whose
``L q`` has a sample's ReLU zeros. :mod:`.sphere` is SPEAR++'s search on the sphere,
:mod:`.sparsity` finds and polishes the zeros, :mod:`.mixtures` splits two known directions'
mixtures, :mod:`.last_direction` and :mod:`.pattern_scan` scan ReLU patterns for the last
directions, :mod:`.aimed_rounds` aims the search at what is still missing.
"""
