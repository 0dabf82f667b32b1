"""``python -m shoal.clients.loadtest`` is ``shoal-load``."""

from shoal.clients.loadtest.cli import main

raise SystemExit(main())
