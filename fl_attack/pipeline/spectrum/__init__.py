"""The spectrum stage: observed update in, low-rank factors and batch size out.

In: a layer's weight update ``dW`` (m x n) and bias update ``db``. Out: the factors
``L`` (m x b) and ``R`` (b x n) with ``dW = L R``, and b from the singular-value gap
(:mod:`.decompose`); for large noisy updates the spectrum from the Gram matrix
(:mod:`.gram_spectrum`).
"""
