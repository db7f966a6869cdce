"""``python -m kvbridge.sim --seed N`` / ``--schedules N``: see :mod:`kvbridge.sim.cli`."""

import sys

from kvbridge.sim.cli import main

if __name__ == "__main__":      # test_records imports every module of the package
    sys.exit(main())
