"""``python -m clients.loadtest`` is ``shoal-load``."""

from clients.loadtest.cli import main

raise SystemExit(main())
