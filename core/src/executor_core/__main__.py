"""``python -m executor_core``: the ``executor`` command (also under ``torchrun -m``)."""

import sys

from ._cli import main

sys.exit(main())
