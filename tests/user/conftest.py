"""The user-install tier runs only in the venv `make user-tier` builds (STOKER_USER_TIER=1):
there, an install of `stoker[torch,stream,parquet]` with pytest and nothing else. The test
environment's run skips it, since s3fs and moto are installed there and would hide what
the tier is for."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("STOKER_USER_TIER") == "1" else ["test_user_install.py"]
