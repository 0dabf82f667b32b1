"""``python -m shoal.frontend FD``: a front-end worker process (see ``shoal.frontend.worker``)."""

import sys

from shoal.frontend.worker import main

sys.exit(main())
