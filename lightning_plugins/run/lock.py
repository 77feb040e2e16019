"""One run per output directory: a run takes ``output_dir`` for itself with a lock file, framework-free.

The lock file (``output_dir/run.lock``, JSON) names the holder: host, pid, the process's start time (so a reused pid
is told apart), when the run started and its command line. A second run on the same directory is refused at once,
naming the holder and how to proceed. A lock left by a run that is gone is taken over with a one-line notice:

* same host: the pid is gone, or it now belongs to another process (another start time);
* another host: the holder touches the file every :data:`HEARTBEAT_S` seconds; a file untouched for
  :data:`STALE_AFTER_S` seconds is a dead run's (its host cannot be asked about its pid).

Only one process per job takes it (the doors call :func:`take_run_lock` on global rank 0 only). It is released when
the run ends however it ends: by the door (``finally``), at interpreter exit, and on SIGTERM (where nothing else
handles it, SIGTERM then ends the run as an exit does). A SIGKILLed run leaves its lock behind: the next run finds it
stale.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from lightning_plugins.errors import RunLockError
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

#: The lock file, inside the output directory.
LOCK_NAME = "run.lock"
#: How often the holder touches its lock file (seconds).
HEARTBEAT_S = 30.0
#: A lock of another host untouched for this long (seconds) belongs to a run that is gone.
STALE_AFTER_S = 300.0


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, from ``/proc``); ``None`` where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name (which may hold spaces)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def describe_holder(holder: dict[str, Any]) -> str:
    """``host H, pid P, started T, command C`` for a lock file's content."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return (
        f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {started},"
        f" command {holder.get('command', '?')!r}"
    )


def stale_reason(holder: dict[str, Any], age_s: float, stale_after_s: float = STALE_AFTER_S) -> str | None:
    """Why the run that wrote ``holder`` is gone (``None`` when it may still be running); ``age_s``: seconds since the
    lock file was last touched."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        if not _pid_alive(pid):
            return f"pid {pid} is gone"
        start = _process_start(pid)
        if start is not None and holder.get("pid_start") not in (None, start):
            return f"pid {pid} now belongs to another process"
        return None
    if age_s > stale_after_s:
        return f"its lock was last touched {age_s:.0f} s ago (a live run touches it every {HEARTBEAT_S:g} s)"
    return None


class RunLock:
    """A run's hold on its output directory; :meth:`release` gives it back (idempotent)."""

    def __init__(self, path: Path, token: str, heartbeat_s: float) -> None:
        self.path, self.token = path, token
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeat_s,), daemon=True, name="lightning-plugins-run-lock"
        )
        self._heartbeat.start()
        atexit.register(self.release)
        in_main = threading.current_thread() is threading.main_thread()
        if in_main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _beat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Where SIGTERM would end the process at once (no handler but this one), end it as an exit does: ``finally``
        blocks and exit handlers run, the lock is released. A handler installed since (Lightning composes the one it
        finds with its own) ends the run its own way, through the same exit path."""
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            raise SystemExit(128 + signum)

    def release(self) -> None:
        """Remove the lock file if it is still this run's."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.release)
        in_main = threading.current_thread() is threading.main_thread()
        if in_main and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()


def take_run_lock(
    output_dir: str | Path,
    say: Callable[[str], None] | None = None,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    stale_after_s: float = STALE_AFTER_S,
) -> RunLock:
    """Take ``output_dir`` for this run (creating it), or refuse at once if another live run holds it.

    Args:
        output_dir: The run's output directory.
        say: Told, in one line, when the lock of a run that is gone is taken over (default: standard error).
        heartbeat_s: How often the holder touches the lock file.
        stale_after_s: How long another host's lock may go untouched before it counts as a dead run's.

    Raises:
        RunLockError: Another run that is still alive holds ``output_dir``: the message names it and what to do.
    """
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    path = Path(output_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    me = {
        "host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
        "since": time.time(), "command": " ".join([sys.executable, *sys.argv]), "token": token,
    }  # fmt: skip
    for _ in range(3):  # a takeover races at most with another takeover
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder, age = _read(path)
            if holder is None:
                continue  # released meanwhile
            reason = stale_reason(holder, age, stale_after_s)
            if reason is None:
                raise RunLockError(
                    f"{path.parent} is in use by another run ({describe_holder(holder)}). Wait for it to finish, stop"
                    f" it, or give this run another train.output_dir. If that run is gone (e.g. its node failed),"
                    f" remove {path}."
                ) from None
            aside = path.with_name(f"{LOCK_NAME}.stale.{token}")
            with contextlib.suppress(FileNotFoundError):  # only one of two runs taking over wins the rename
                path.rename(aside)
                aside.unlink()
                say(f"Taking over {path} from a run that is gone ({describe_holder(holder)}): {reason}.")
            continue
        with os.fdopen(fd, "w") as handle:
            json.dump(me, handle)
        return RunLock(path, token, heartbeat_s)
    raise RunLockError(f"Could not take {path}: other runs keep taking it. Give this run another train.output_dir.")


def _read(path: Path) -> tuple[dict[str, Any] | None, float]:
    """The lock file's content and the seconds since it was last touched (``None`` if it is gone)."""
    for _ in range(50):  # a holder between creating the file and writing it: wait for its content
        try:
            age = time.time() - path.stat().st_mtime
            return json.loads(path.read_text()), age
        except FileNotFoundError:
            return None, 0.0
        except (ValueError, OSError):
            time.sleep(0.02)
    return {"host": "?", "command": f"unreadable lock file {path}"}, time.time() - path.stat().st_mtime
