#!/usr/bin/env python3
"""Run one command so that stopping it stops everything it started.

    supervise.py COMMAND [ARG...]

The Makefile runs every target through this. The command runs as this
process's child, in the same process group (Ctrl-C reaches it as usual), and:

- this process is a child subreaper (Linux): a process whose parent exits is
  re-parented here instead of to init, so nothing the command started can
  slip away unseen;
- SIGTERM and SIGHUP sent here (make passes SIGTERM on to the recipe it runs,
  and only to it) are passed on to every descendant. SIGINT from the terminal
  has reached the whole foreground process group already and is not sent twice;
- once the command has exited, descendants still running get SIGTERM; all
  get SIGKILL GRACE_S seconds after that or after a signal came here, if they
  are still there. This process exits only when none is left: with the
  command's exit status, or killed by the same signal.

Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

GRACE_S = 30.0
_PR_SET_CHILD_SUBREAPER = 36
_FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def _become_subreaper() -> None:
    # Not Linux: descendants whose parent exits are not seen.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(root: int) -> list[int]:
    """Every process below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _signal_descendants(signum: int) -> list[int]:
    pids = descendants(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
    return pids


def _reap() -> tuple[int, int] | None:
    """One exited child as (pid, wait status), None if none has exited;
    ChildProcessError when no child is left."""
    pid, status = os.waitpid(-1, os.WNOHANG)
    return (pid, status) if pid else None


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    _become_subreaper()
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        if signum in _FORWARDED:
            _signal_descendants(signum)

    for signum in (signal.SIGINT, *_FORWARDED):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, forward)
    try:
        child = os.posix_spawnp(argv[0], argv, os.environ,
                                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    except OSError as e:
        print(f"supervise.py: cannot run {argv[0]}: {e.strerror}", file=sys.stderr)
        return 127
    for signum in received:  # arrived before the child existed
        if signum in _FORWARDED:
            os.kill(child, signum)

    # Poll rather than block in waitpid, so that a deadline can be kept.
    status: int | None = None
    deadline: float | None = None
    while True:
        try:
            exited = _reap()
        except ChildProcessError:  # no child left: the command and all it started are gone
            break
        if exited:
            if exited[0] == child:  # the command is done: stop what it left running
                status = os.waitstatus_to_exitcode(exited[1])
                if left := _signal_descendants(signal.SIGTERM):
                    print(f"supervise.py: stopping {len(left)} process(es) that {argv[0]} "
                          "left running", file=sys.stderr)
                deadline = deadline or time.monotonic() + GRACE_S
            continue  # the command, or an orphan re-parented here
        if received and deadline is None:
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _signal_descendants(signal.SIGKILL)
        time.sleep(0.1)

    assert status is not None
    if status < 0:  # killed by a signal: die of it too, as make expects
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
