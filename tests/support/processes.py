"""Process start methods, as the tests parametrise over them."""

from __future__ import annotations

import multiprocessing

# the start methods this platform has, in the order tests run them
START_METHODS = [m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()]
