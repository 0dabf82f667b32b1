"""lifeline.kill_group: a worker's process group is killed only while its number is still the worker's."""

from __future__ import annotations

import subprocess

from shoal.instances import lifeline


def test_a_group_whose_number_went_to_another_process_is_left_alone() -> None:
    """Review of session 47: a dead worker's pid, given to another model's new worker (which leads a
    group of that number), got that worker killed with the first one's group."""
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True)  # leads a group of its own
    try:
        started = lifeline.start_time(leader.pid)
        assert started is not None
        lifeline.kill_group(leader.pid, started + 1)  # as if this pid were another worker's than the one started then
        assert leader.poll() is None
        lifeline.kill_group(leader.pid, started)
        assert leader.wait(timeout=30) == -9
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait(timeout=30)
