"""The workflow in real OCI containers, through Snakemake's own --use-singularity path.

Marked `container` and deselected by default: scripts/container-test.sh builds docker/Dockerfile
with podman (root) and runs `.test/config/config.yaml` with every job in the image. The `apptainer`
command it puts on PATH is a STAND-IN (scripts/apptainer-podman) that runs each job with
`podman run`; Apptainer itself is in no registry reachable where this was written.
Run: `python -m pytest -m container -s tests/test_container.py`.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.container
def test_test_config_runs_every_job_in_the_image(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "container-test.sh"), str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=5400, env={**os.environ, "PYTHON": sys.executable})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    print("\n" + (tmp_path / "timings.txt").read_text())
    log = (tmp_path / "snakemake.log").read_text()
    total = int(re.search(r"^total\s+(\d+)", log, re.M).group(1))
    calls = (tmp_path / "apptainer-calls.log").read_text().splitlines()
    # every job but the `all` target (which has no command) went through the container
    assert len(calls) == total - 1, (len(calls), total)
    assert all(c.startswith("localhost/bppsa:test ") for c in calls)
    run = tmp_path / "run"
    env = json.loads((run / "results" / "container-cpu" / "environment.json").read_text())
    assert env["scheduler"]["apptainer_container"] == "localhost/bppsa:test"  # set by the container run only
    for name in ["fig_7.png", *[f"fig_8_{p}.png" for p in "abcdef"], "fig_9.png", "fig_13.png", "fig_10.png"]:
        assert (run / "results" / name).read_bytes()[:4] == b"\x89PNG", name
    assert (run / "results" / "report.md").stat().st_size > 0
