"""`python -m rlfeed` is the `rlfeed` command."""

import sys

from rlfeed.service.cli import main

sys.exit(main())
