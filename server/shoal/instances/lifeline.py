"""Every process started for instances dies with the host, however the host dies (SIGKILL, OOM kill).

A worker outliving its host holds memory (GPU memory on a GPU host) and, stuck in ``execute``,
holding a non-daemon thread or blocking in ``finalize``, it never ends by itself. Workers are
children of multiprocessing's fork server, not of the host, and every worker holds the fork
server's "alive" pipe and the resource tracker's pipe, so those two outlive the host as long as
one worker does. The kernel ends the chain from the top, whatever each process is doing:

    host ──PDEATHSIG──▶ fork server ──PDEATHSIG──▶ each worker

PDEATHSIG fires when the *thread* that forked a child ends, so every worker is started on one
launcher thread that lives as long as the host (``launch``): the fork server is spawned by that
thread, and sets its own PDEATHSIG when it imports ``shoal.instances.forkserver_guard`` (a preload
module); the fork server is single-threaded, so a worker's PDEATHSIG is tied to its whole life.
Once the fork server and the workers are gone, the resource tracker reads EOF and exits.

A worker also watches its pipe from a thread (``watch_host``): when the host's end closes, it
kills itself. That covers the moments before PDEATHSIG is set (a host that dies while a worker
starts) and a fork server not started by ``launch``.

What a worker's model starts itself (``subprocess.Popen``, ``os.fork``) is not Shoal's, and no
PDEATHSIG reaches it; left alone it outlived the worker, its unload and the server, holding the
worker's arenas (review of session 47). So a worker leads a process group of its own (``guard_worker``),
which those processes join unless they leave it, and the host kills the group with the worker
(``kill_group``, which checks that the number is still the worker's group's): on unload, on a
restart, at shutdown. A host that dies by SIGKILL takes its workers with it but not their processes.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import select
import signal
import threading
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)

HOST_PID_ENV = "SHOAL_INSTANCE_HOST_PID"  # read by the fork server: the process it must die with
_PR_SET_PDEATHSIG = 1
_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR
# One thread that never ends before the host: the fork server's PDEATHSIG is tied to it.
_launcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-instance-launcher")


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the thread that forked it) dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def launch(process: BaseProcess) -> None:
    """Start ``process`` (a forkserver context's) on the launcher thread, so that a fork server it
    spawns dies with this process, not with the calling thread."""
    os.environ[HOST_PID_ENV] = str(os.getpid())
    _launcher.submit(process.start).result()


def guard_forkserver() -> None:
    """In the fork server, before it forks anything: die with the host that spawned it, and never of
    a request the host gave up half-way (``_survive_abandoned_requests``)."""
    host = os.environ.get(HOST_PID_ENV, "")
    if host.isdigit() and int(host) != os.getpid():
        die_with_parent(int(host))
    _survive_abandoned_requests()


def _survive_abandoned_requests() -> None:
    """A host out of descriptors connects to the fork server, then fails to make the pipes of its
    request (EMFILE) and closes the connection with nothing sent: the fork server's read of the
    request's descriptors raises EOFError, which its loop (CPython 3.11's ``forkserver.main``) does not
    catch, so it ended, and every worker of every model died with it (review of session 53). Read as
    the aborted connection it is (ECONNABORTED), which the loop skips: one launch fails, the rest live."""
    from multiprocessing import reduction

    receive = reduction.recvfds

    def recvfds(sock: Any, size: int) -> list[int]:
        try:
            found: list[int] = receive(sock, size)
        except EOFError:
            raise ConnectionAbortedError(errno.ECONNABORTED, "a request closed before its descriptors came") from None
        return found

    reduction.recvfds = recvfds


def guard_worker(conn: Any) -> None:
    """In a worker, first thing: die with the fork server (the kernel), and with the host's end of
    ``conn``; lead a process group of its own, for what the model starts (``kill_group``); let go of
    the fork server's "alive" pipe (``_drop_forkserver_pipe``)."""
    die_with_parent(os.getppid())
    os.setpgid(0, 0)
    _drop_forkserver_pipe()
    watch_host(conn)


def _drop_forkserver_pipe() -> None:
    """Close the write end of the pipe by which the fork server learns that its host is gone, which
    multiprocessing hands every process it starts: a byte written on it (a model writing where it
    should not) ended the fork server, and every other model's worker died with it (review of session
    50). The fork server still ends with the host, whose end closes then (and by PDEATHSIG). Should the
    model itself use a fork server, multiprocessing starts one of its own (it holds no address of ours)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - where _serve_one put the inherited descriptor
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        setattr(server, "_forkserver_alive_fd", None)  # noqa: B010 - a private attribute typeshed does not list
        try:
            os.close(alive)
        except OSError:
            pass


def start_time(pid: int | None) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc), or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError, TypeError):
        return None


def kill_group(worker_pid: int | None, started: int | None) -> None:
    """In the host, to end a worker: SIGKILL its process group (the worker, if alive, and the
    processes its model started). The group's number is the worker's pid, which the kernel gives to
    no new process while the group has a member. So: when a process with that pid started at another
    time than the worker (``started``), the number was given again, so no member of the worker's group
    was left, and nothing is sent (a pid reused by another model's worker, which leads a group of
    that number: review of session 47)."""
    if worker_pid is None or started is None:
        return
    now = start_time(worker_pid)
    if now is not None and now != started:
        return
    try:
        os.killpg(worker_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # none left (or the worker never led one)
        pass


def watch_host(conn: Any) -> None:
    """Kill this process once the host's end of ``conn`` is closed, whatever its other threads do."""
    fd = os.dup(conn.fileno())  # its own descriptor: the worker may close ``conn`` while it ends
    threading.Thread(target=_kill_on_hangup, args=(fd,), name="shoal-host-watch", daemon=True).start()


def _kill_on_hangup(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)  # the peer's close only: data on the pipe does not wake it
    while True:
        if any(events & _HANGUP for _, events in poller.poll()):
            os.kill(os.getpid(), signal.SIGKILL)
