"""Directory names of attacked units: readable, short enough for any file system, never shared.

A client name is used as its directory's name when it is at most :data:`MAX_DIRECTORY_NAME`
characters. A longer one (a secure-aggregation group of 20 clients is about 250 characters,
and most file systems stop at 255 bytes per name) is stored under a short readable name plus
the first characters of the SHA-256 of the full name, e.g.
``secagg-partition-0-and-19-more-3f2a9c01de``; the full name stays in the table's ``client``
column and in ``metrics.json``.
"""

from __future__ import annotations

import hashlib

#: Longest client name used as a directory name as it is.
MAX_DIRECTORY_NAME = 80
#: Hex digits of the SHA-256 of the full name appended to a shortened name.
HASH_DIGITS = 10
#: Prefix of a secure-aggregation group's name; members follow, joined by ``_``.
SECAGG_PREFIX = "secagg-"
#: Put between a unit's directory name and N for the N-th (N >= 2) directory of the same
#: (round, client): ``partition-0-dup2``.
DUPLICATE_SEPARATOR = "-dup"

_MEMBER_SEPARATOR = "_"
#: Characters kept from the start of a long name that is not a secure-aggregation group.
_KEPT_PREFIX = MAX_DIRECTORY_NAME - HASH_DIGITS - 1


def unit_directory_name(client: str) -> str:
    """The directory name of ``client``: itself when short, else a short name plus a hash.

    Parameters
    ----------
    client : str
        A directory-safe client name (see :class:`~fl_attack.results.record.AttackRecord`).

    Returns
    -------
    str
        At most :data:`MAX_DIRECTORY_NAME` characters; distinct names give distinct results
        (up to a collision of :data:`HASH_DIGITS` hex digits of SHA-256).

    Examples
    --------
    >>> unit_directory_name("partition-3")
    'partition-3'
    >>> unit_directory_name("secagg-" + "_".join(f"partition-{i}" for i in range(20)))[:31]
    'secagg-partition-0-and-19-more-'
    """
    if len(client) <= MAX_DIRECTORY_NAME:
        return client
    digest = hashlib.sha256(client.encode("utf-8")).hexdigest()[:HASH_DIGITS]
    if client.startswith(SECAGG_PREFIX):
        members = client[len(SECAGG_PREFIX) :].split(_MEMBER_SEPARATOR)
        if len(members) > 1 and members[0]:
            readable = f"{SECAGG_PREFIX}{members[0]}-and-{len(members) - 1}-more-{digest}"
            if len(readable) <= MAX_DIRECTORY_NAME:
                return readable
    kept = client[:_KEPT_PREFIX].rstrip("-_.")
    return f"{kept}-{digest}"
