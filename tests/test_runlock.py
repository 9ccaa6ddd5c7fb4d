"""A lock left by a killed Snakemake is removed at the next start, and only then: never a live run's, another
host's, or one whose owner was not recorded after it was taken."""
import json
import os
import subprocess
import time

from bppsa.runlock import OWNER, clear_stale_lock, record_owner


def _locks(d, mtime=None):
    (d / "locks").mkdir(parents=True, exist_ok=True)
    for name in ("0.input.lock", "0.output.lock"):
        p = d / "locks" / name
        p.write_text("results/x.csv\n")
        if mtime is not None:
            os.utime(p, (mtime, mtime))


def _sleeper():
    return subprocess.Popen(["sleep", "30"])


def test_the_lock_of_a_killed_run_is_removed(tmp_path):
    _locks(tmp_path, mtime=time.time() - 5)
    p = _sleeper()
    record_owner(tmp_path, pid=p.pid)  # recorded while it ran
    p.kill()
    p.wait()
    msg = clear_stale_lock(tmp_path)
    assert msg and f"process {p.pid}" in msg and "no longer running" in msg
    assert not list((tmp_path / "locks").glob("*.lock")) and not (tmp_path / OWNER).exists()


def test_a_live_run_keeps_its_lock(tmp_path):
    _locks(tmp_path, mtime=time.time() - 5)
    record_owner(tmp_path)  # this process, alive
    assert clear_stale_lock(tmp_path) is None
    assert len(list((tmp_path / "locks").glob("*.lock"))) == 2


def test_a_reused_pid_is_not_the_owner(tmp_path):
    _locks(tmp_path, mtime=time.time() - 5)
    path = record_owner(tmp_path)
    owner = json.loads(path.read_text())
    path.write_text(json.dumps({**owner, "start": str(int(owner["start"]) - 1)}))  # same pid, another process
    assert clear_stale_lock(tmp_path) is not None


def test_another_hosts_lock_or_an_unrecorded_one_stays(tmp_path):
    _locks(tmp_path, mtime=time.time() - 5)
    assert clear_stale_lock(tmp_path) is None  # no owner recorded
    p = _sleeper()
    path = record_owner(tmp_path, pid=p.pid)
    p.kill()
    p.wait()
    path.write_text(json.dumps({**json.loads(path.read_text()), "host": "another-node"}))
    assert clear_stale_lock(tmp_path) is None
    path = record_owner(tmp_path, pid=p.pid)
    _locks(tmp_path, mtime=time.time() + 5)  # taken after the owner was recorded: a run not yet at onstart
    assert clear_stale_lock(tmp_path) is None
    assert len(list((tmp_path / "locks").glob("*.lock"))) == 2
