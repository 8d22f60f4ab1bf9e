"""``python -m kvevents.cli``."""

from kvevents.cli import main

raise SystemExit(main())
