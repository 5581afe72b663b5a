"""``python -m benchmarks SUITE``: the driver in benchmarks/run.py."""

import sys

from benchmarks.run import main

sys.exit(main())
