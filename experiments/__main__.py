"""``python -m experiments``: see :mod:`experiments.cli`."""

import sys

from experiments.cli import main

sys.exit(main())
