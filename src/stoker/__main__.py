"""`python -m stoker`: the `stoker` command."""

import sys

from ._cli import main

sys.exit(main())
