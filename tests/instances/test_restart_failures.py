"""A process instance whose worker cannot be started again (review of session 50, F2).

Starting a worker can fail with an OSError of the operating system's, not the model's: the fork
server gone (ConnectionRefusedError), no process or descriptor left (EAGAIN, EMFILE). Such a restart
was not caught: the instance kept a process never started, every later batch failed with
"can only join a started process" for good, and the server's shutdown stopped at that instance
(a traceback, exit 1, the other models never unloaded). Now the restart fails like any other (the
instance stays unhealthy, its batches UNAVAILABLE), the next batch tries again, and closing it works.
"""

from __future__ import annotations

import os
import signal
import socket
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shoal.backends.devices import CPU
from shoal.configuring.pipeline import configure
from shoal.errors import ErrorCode, ShoalError
from shoal.instances import lifeline
from shoal.instances.process import WorkerLimits
from shoal.instances.python_process import PythonProcessModel
from tests import python_models as pm
from tests.polling import wait_until


class Pending:
    """A queued request as an executor hands it to the instance."""

    def __init__(self, value: np.ndarray) -> None:
        self.feed = {"X": value}
        self.outputs, self.size, self.context = ("Y",), 1, None


def _model(tmp_path: Path) -> PythonProcessModel:
    folder = tmp_path / "double"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(pm.DOUBLE_CONFIG).lstrip())
    (folder / "1" / "model.py").write_text(textwrap.dedent(pm.DOUBLE).lstrip())
    spec = configure(folder, strict=False).spec
    return PythonProcessModel(spec, folder / "1" / "model.py", CPU, "double_0", 1, WorkerLimits(0.0, 0.0))


def _kill(model: PythonProcessModel) -> None:
    pid = model.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 30, "the worker to be gone")  # reaped by the fork server


def test_a_restart_failing_with_an_os_error_leaves_the_instance_unhealthy_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tmp_path)
    value = np.array([[1.0, 2.0]], np.float32)
    try:
        assert model.run_requests([Pending(value)])[0]["Y"].tolist() == [[2.0, 4.0]]

        def refused(process: Any) -> None:
            raise ConnectionRefusedError(111, "Connection refused")

        monkeypatch.setattr(lifeline, "launch", refused)
        _kill(model)
        with pytest.raises(ShoalError) as died:  # the batch that finds the worker dead
            model.run_requests([Pending(value)])
        assert died.value.code is ErrorCode.UNAVAILABLE and "could not be restarted" in died.value.message
        assert not model.healthy
        for _ in range(2):  # each batch tries the restart again, and fails as a restart fails
            with pytest.raises(ShoalError) as failed:
                model.run_requests([Pending(value)])
            assert failed.value.code is ErrorCode.UNAVAILABLE, failed.value
            assert "could not be restarted" in failed.value.message and "Connection refused" in failed.value.message

        monkeypatch.undo()
        assert model.run_requests([Pending(value)])[0]["Y"].tolist() == [[2.0, 4.0]]  # started again
        monkeypatch.setattr(lifeline, "launch", refused)
        _kill(model)
        with pytest.raises(ShoalError):
            model.run_requests([Pending(value)])
    finally:
        model.close()  # also with a worker that never started


def test_a_restart_failing_before_its_launch_leaves_the_instance_unhealthy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 53: a Python worker's restart makes a pipe for its metrics first (and a thread), whose
    OSError (no descriptor left) escaped the restart: the batch failed with an incident, and a
    watchdog's restart would have ended its thread. It fails as a restart fails."""
    model = _model(tmp_path)
    value = np.array([[1.0, 2.0]], np.float32)
    try:
        assert model.run_requests([Pending(value)])[0]["Y"].tolist() == [[2.0, 4.0]]

        def no_descriptor(*args: Any, **kwargs: Any) -> Any:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(model._context, "Pipe", no_descriptor)
        _kill(model)
        with pytest.raises(ShoalError) as died:  # the batch that finds the worker dead
            model.run_requests([Pending(value)])
        assert died.value.code is ErrorCode.UNAVAILABLE and "could not be restarted" in died.value.message
        with pytest.raises(ShoalError) as failed:  # the next tries again, and says why it failed
            model.run_requests([Pending(value)])
        assert failed.value.code is ErrorCode.UNAVAILABLE, failed.value
        assert "could not be restarted: OSError: [Errno 24] Too many open files" in failed.value.message
        monkeypatch.undo()
        assert model.run_requests([Pending(value)])[0]["Y"].tolist() == [[2.0, 4.0]]  # started again
    finally:
        model.close()


def test_a_launch_given_up_half_way_leaves_the_fork_server_and_every_worker_alive(tmp_path: Path) -> None:
    """Review of session 53: a host out of descriptors connects to the fork server, fails to make the
    pipes of its request and closes the connection with nothing sent. The fork server's loop did not
    catch the EOFError of that read: it ended, and every worker of every model died with it. Now the
    one launch fails and the rest live on."""
    from multiprocessing import forkserver

    model = _model(tmp_path)
    value = np.array([[1.0, 2.0]], np.float32)
    try:
        assert model.run_requests([Pending(value)])[0]["Y"].tolist() == [[2.0, 4.0]]
        pid = model.pid
        address = forkserver._forkserver._forkserver_address  # noqa: SLF001 - the fork server's socket
        with socket.socket(socket.AF_UNIX) as abandoned:
            abandoned.connect(address)  # and closed with nothing sent, as the descriptor-starved host does
        other = _model(tmp_path / "other")  # the fork server still forks
        try:
            assert other.run_requests([Pending(value)])[0]["Y"].tolist() == [[2.0, 4.0]]
        finally:
            other.close()
        assert model.pid == pid and model.run_requests([Pending(value)])[0]["Y"].tolist() == [[2.0, 4.0]]
    finally:
        model.close()
