"""The selection stage: the candidate pool in, the recovered inputs and their verdict out.

:mod:`.select` chooses b directions that explain the update and scales them into inputs,
:mod:`.polish` re-fits each on the zeros its own sample gives, :mod:`.precision` estimates each
row's error from the update alone, :mod:`.self_check` decides what may be claimed, and
:mod:`.near_duplicates` separates near-identical samples and checks that a claimed batch is
unique.
"""
