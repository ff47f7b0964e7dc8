"""Imported first by every script: puts the repository on sys.path, so that a GPU host runs the
scripts from a plain checkout (`python3 scripts/bench_gpu.py`) and they import testkit and the
product from it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
