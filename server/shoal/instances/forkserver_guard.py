"""Imported by multiprocessing's fork server only (the first of its preload modules): from here on it
dies with the host that spawned it, so its workers do too (``shoal.instances.lifeline``).

Nothing else imports this module: importing it is the one thing it does.
"""

from shoal.instances import lifeline

lifeline.guard_forkserver()
