"""``python -m kvbridge.sim --seed N`` / ``--schedules N``: see :mod:`kvbridge.sim.cli`."""

import sys

from kvbridge.sim.cli import main

sys.exit(main())
