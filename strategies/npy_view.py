"""Read an ``.npy`` payload (a Flower ``Array``'s bytes) as a read-only array over those bytes.

``numpy.load`` copies the payload out of the bytes. The audit keeps one layer of every reply
until its attack starts; during the round the reply's bytes are alive anyway (the strategy
aggregates them), so a copy would hold every client's layer twice, 100 clients' at once at the
end of a round. An array over the reply's own bytes holds nothing more, and it keeps the bytes
(one array's, not the reply's) alive afterwards only as long as the audit keeps the layer.
"""

from __future__ import annotations

import io
import math

import numpy as np
from numpy.lib import format as npy_format


def npy_view(data: object) -> np.ndarray | None:
    """The array stored in the ``.npy`` bytes ``data``, sharing (not copying) those bytes.

    Parameters
    ----------
    data : object
        The serialized array; only immutable ``bytes`` are read in place.

    Returns
    -------
    numpy.ndarray or None
        A read-only array equal, element for element and in dtype and shape, to what
        ``numpy.load`` returns; None when the payload is not read in place (not ``bytes``, another
        format version, an object dtype, a size that does not match the header): read it with
        ``numpy.load`` then, which raises on a malformed payload.
    """
    if type(data) is not bytes:
        return None
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_2_0(stream)
        else:
            return None
    except ValueError:
        return None
    if dtype.hasobject:
        return None
    count, offset = math.prod(shape), stream.tell()
    if len(data) - offset != count * dtype.itemsize:
        return None
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran_order else "C")
