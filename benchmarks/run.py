"""`python benchmarks/run.py [options]`: the benchmark harness (W1-W12 side by side with
torch.utils.data; `--gpu`, the GPU feed benchmark), run from a clone. `--help` lists the
options; see benchmarks/README.md."""

import os
import sys

try:
    import stoker_bench  # noqa: F401  (installed by `make setup`, or found beside this file)
except ImportError:  # python -P, or PYTHONSAFEPATH set: this file's folder is not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stoker_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
