"""`PYTHONPATH=tests python -m fuzz --messages 100000 --epochs 40`: the full fuzz (fuzz/run.py), from the repository's
root (tests/ on the path, as pytest puts it there for the tests)."""

import sys

from fuzz.run import main

sys.exit(main())
