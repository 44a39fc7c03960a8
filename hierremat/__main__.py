"""``python -m hierremat``: see hierremat.api.cli."""

import sys

from .api.cli import main

sys.exit(main())
