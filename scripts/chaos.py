"""Chaos under load: `tokenfleet up` serves mixed traffic while processes are killed at random;
then every promise of the fleet is checked (the report in docs/fault-tolerance.md).

    PYTHONPATH=. python scripts/chaos.py --minutes 30                  # by hand, the long run
    PYTHONPATH=. python scripts/chaos.py --minutes 0.5 --fault-interval-s 4 --short   # the suite

The harness is testkit/chaos/ (tests/test_chaos.py checks its checks, and runs this script).
"""

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from testkit.chaos.harness import main

if __name__ == "__main__":
    raise SystemExit(main())
