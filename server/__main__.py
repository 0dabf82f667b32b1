"""``python -m server`` is the ``shoal`` command."""

from server.cli import main

raise SystemExit(main())
