"""``python -m hierremat``: see hierremat.cli."""

import sys

from .cli import main

sys.exit(main())
