"""`python -m stoker`: the `stoker` command."""

import sys

from ._doctor.cli import main

sys.exit(main())
