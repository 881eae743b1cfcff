"""`python benchmarks/mix_bench.py [options]`: the mixing and packing benchmark (issue 34), run
from a clone: stoker's mix and packers beside Grain's and torchdata.nodes' on a real text corpus
(the installed packages' files). `--help` lists the options; see `stoker_bench/mixpack.py`."""

import os
import sys

try:
    import stoker_bench  # noqa: F401  (installed by `make setup`, or found beside this file)
except ImportError:  # python -P, or PYTHONSAFEPATH set: this file's folder is not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stoker_bench.mixpack import main

if __name__ == "__main__":
    sys.exit(main())
