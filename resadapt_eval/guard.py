"""A cell's lmms-eval run in its own process group, ended with whatever started it.

`run_guarded` starts `python -m resadapt_eval.guard --watch PID ... -- CMD`: the guard
starts CMD as the leader of a new session (its own process group, which a launcher's workers join)
and ends that whole group (SIGTERM, then SIGKILL after a grace period) when the process that
started it or any other watched process ends, even by SIGKILL, or when the guard is sent SIGTERM,
SIGINT or SIGHUP. So a sweep killed with `kill -9` leaves no lmms-eval process behind, and Ctrl-C
in a terminal (which reaches the guard, not the new session) ends the cell too. On Linux the
command's main process also gets PR_SET_PDEATHSIG=SIGKILL, should the guard itself be killed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ENDED_EXIT = 86  # the guard's exit code when it ended the command's group (its reason is its last stderr line)
GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL to the group
POLL_S = 0.25  # seconds between checks of the watched processes
PR_SET_PDEATHSIG = 1


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), which tells a
    process from a later one given the same pid; None where /proc cannot say."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` runs (a zombie has ended), and is the one that started at `started`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with this pid
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill(0) found it
    return fields[0] not in ("Z", "X") and (started is None or fields[19] == started)


def run_guarded(cmd: list[str], log: Path, watch: Iterable[int] = ()) -> int:
    """Run `cmd` (stdout and stderr into `log`) in its own process group under a guard that ends
    the group when this process or any `watch` process ends; returns its exit code (128 + N for
    signal N; ENDED_EXIT: the guard ended it). Interrupted here (KeyboardInterrupt, SystemExit, a
    submitit requeue), it ends the group before the exception goes on."""
    watched = [os.getpid(), *watch]
    guard = [sys.executable, "-m", "resadapt_eval.guard", *(f"--watch={pid}" for pid in watched), "--", *cmd]
    with open(log, "w") as out:
        proc = subprocess.Popen(guard, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=GRACE_S + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def exit_description(returncode: int) -> str:
    """`was killed by SIGKILL` for a process ended by a signal (a negative code, or 128 + N as this
    guard and shells report it), else `exited with exit code N`."""
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 128 + signal.NSIG else None
    if number is not None:
        try:
            return f"was killed by {signal.Signals(number).name} (exit code {returncode})"
        except ValueError:
            pass
    return f"exited with exit code {returncode}"


def end_group(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the child's process group, SIGKILL to what is left after `grace_s` seconds."""
    if grace_s > 0:
        try:
            os.killpg(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group has ended
        pass
    child.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m resadapt_eval.guard",
        description="run a command in its own process group; end the group when a watched process ends",
    )
    parser.add_argument("--watch", type=int, action="append", default=[], help="a process id whose end ends the group")
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    watched = {pid: start_time(pid) for pid in args.watch}
    signals: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: signals.append(signal.Signals(signum).name))
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def die_with_guard():  # in the child before exec: SIGKILL to it when the guard dies (Linux)
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    child = subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_guard)
    while child.poll() is None:
        ended = [pid for pid, started in watched.items() if not process_alive(pid, started)]
        reason = f"received {signals[0]}" if signals else f"process {ended[0]} ended" if ended else None
        if reason:
            end_group(child, args.grace)
            print(f"resadapt-eval guard: {reason}; ended the cell's process group {child.pid}", file=sys.stderr)
            return ENDED_EXIT
        time.sleep(POLL_S)
    end_group(child, 0)  # whatever the command left running in its group
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main())
