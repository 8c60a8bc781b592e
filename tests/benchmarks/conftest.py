"""The benchmark scripts of benchmarks/ are scripts, not a package: put their folder on the path so that the tests
import them by name, as `python benchmarks/NAME.py` finds its siblings."""

import sys
from pathlib import Path


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
