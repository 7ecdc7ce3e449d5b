"""``python -m deepmd_hybridmuon check input.json``."""

import sys

from .cli import main

sys.exit(main())
