"""stoker's benchmark harness, kept in the repository and out of the installed package.

`python benchmarks/run.py [options]` runs it from a clone (see benchmarks/README.md); `make
setup` also installs it, editable, as `stoker-bench`. The modules: `bench` (W1-W8: the
workloads, timing, results, the table and the chart), `jpegbench` (W9), `startbench` (W10 and
W11), `w12` (W12, torchvision's ImageNet pipeline over an ImageFolder), `raybench` (the Ray
rows, with W2), `gpubench` (`--gpu`) and `cli` (the options). It
uses stoker's private modules freely: it is measured against stoker's insides, not its API.
"""

import os
import sys

# The folder that holds this package: what a fresh interpreter (the Ray two-node run, a
# benchmark's subprocess) needs on PYTHONPATH when the harness is not installed.
HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The clone's root. The S3 server and its fault proxy are the tests' (tests/support/s3server.py):
# the harness borrows them from there, and the tests never import the harness for them.
REPO = os.path.dirname(HOME)


def with_test_support() -> None:
    """Put the clone's root on sys.path (at its end), so that `tests.support` imports."""
    if REPO not in sys.path:
        sys.path.append(REPO)
