"""A lock left behind by a killed run must not stop the next start.

Snakemake (9.x) writes its locks to ``.snakemake/locks/`` and deletes them when it exits. Killed with SIGKILL (a
lost node, a walltime, the OOM killer) it cannot, and the next start stops with ``LockException`` until the user
runs ``--unlock``. The locks do not say which process wrote them, so the workflow records that itself:
``record_owner`` (called from ``onstart``, right after Snakemake has taken its lock) writes the host, pid and
process start time of the Snakemake process to ``.snakemake/bppsa-lock-owner.json``; ``clear_stale_lock`` (called
when the next start parses the Snakefile, before Snakemake checks the lock) deletes the locks only when their
owner is known to be gone: recorded on this host after the locks were written, and no process with that pid and
start time running. A lock of a live run, of a run on another host, or one without a recorded owner stays, and
Snakemake reports it as it always does.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

OWNER = "bppsa-lock-owner.json"


def _start_time(pid: int) -> str | None:
    """The process' start time in clock ticks since boot (field 22 of /proc/<pid>/stat): with the pid it names one
    process, where a pid alone may have been reused. None where there is no such process or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # the fields after the command name start at field 3


def _alive(pid: int, start: str | None) -> bool:
    if Path("/proc/self/stat").exists():
        now = _start_time(pid)
        return now is not None and (start is None or now == start)
    try:  # no /proc (macOS): the pid alone, so a reused pid keeps the lock
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def record_owner(snakemake_dir: str | Path = ".snakemake", pid: int | None = None) -> Path:
    """Write who holds the locks: this host, ``pid`` (this process by default) and its start time."""
    pid = os.getpid() if pid is None else pid
    path = Path(snakemake_dir) / OWNER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{pid}.tmp")
    tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "start": _start_time(pid)}))
    tmp.replace(path)
    return path


def clear_stale_lock(snakemake_dir: str | Path = ".snakemake") -> str | None:
    """Delete the locks of a run that is known to be gone; returns what was done, None if nothing was."""
    locks = sorted((Path(snakemake_dir) / "locks").glob("*.lock"))
    owner_path = Path(snakemake_dir) / OWNER
    if not locks or not owner_path.is_file():
        return None
    try:
        owner = json.loads(owner_path.read_text())
        host, pid, start = owner["host"], int(owner["pid"]), owner.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return None  # another machine's process: no way to tell from here
    if max(p.stat().st_mtime for p in locks) > owner_path.stat().st_mtime:
        return None  # locks taken after the owner was recorded: a run that has not reached onstart yet
    if _alive(pid, start):
        return None
    for p in locks:
        p.unlink(missing_ok=True)
    owner_path.unlink(missing_ok=True)
    return (f"removed the lock of Snakemake process {pid} on {host}, which is no longer running "
            f"(killed?); its incomplete jobs run again")
