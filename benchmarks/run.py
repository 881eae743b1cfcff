"""`python benchmarks/run.py [options]` is `stoker bench [options]`: W1-W7 side by side with
torch.utils.data. See benchmarks/README.md."""

import sys

from stoker._tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
