"""`python benchmarks/shards_bench.py [options]`: the streaming benchmark (issue 33), run from a
clone: the same JPEG samples read from a local S3 server by stoker, litdata, MosaicML
Streaming, WebDataset and Hugging Face `datasets`. `--help` lists the options; see
`stoker_bench/streambench.py`. `--cache-sweep [options]` measures instead how many times each
shard is downloaded per epoch under caps of a few windows (`stoker_bench/cachesweep.py`)."""

import os
import sys

try:
    import stoker_bench  # noqa: F401  (installed by `make setup`, or found beside this file)
except ImportError:  # python -P, or PYTHONSAFEPATH set: this file's folder is not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stoker_bench.streambench import main

if __name__ == "__main__":
    sys.exit(main())
