"""`python -m rlfeed.service.cli` is the `rlfeed` command (as `python -m rlfeed` is)."""

import sys

from rlfeed.service.cli import main

sys.exit(main())
