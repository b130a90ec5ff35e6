"""Image priors applied after an attack, not part of it (used by the DP experiments).

:mod:`.denoise` estimates the noise each recovered input carries under DP and offers an
optional image prior against it; :mod:`.pixel_range_scale` gives a scale prior for noisy images
from how far their pixels reach toward the pixel range.
"""
