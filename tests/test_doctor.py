"""`bppsa doctor`: runs on any machine, says what works and what to fix."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bppsa import doctor
from bppsa.backends.twin import TorchBackend


def _run(*args):
    return subprocess.run([sys.executable, "-m", "bppsa", "doctor", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's report")
def test_json_on_a_cpu_machine():
    proc = _run("--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["device"] == "cpu" and rep["torch"] == torch.__version__ and rep["cuda_available"] is False
    assert set(rep["backends"]) == {"torch", "cupy", "cupy-factored", "cpu"}
    assert rep["backends"]["cpu"]["ok"] is True  # the CPU fast path, checked like the others
    assert rep["backends"]["torch"]["ok"] is True and "verify rnn float64" in rep["backends"]["torch"]["reason"]
    cupy = rep["backends"]["cupy"]
    assert cupy["ok"] is False and "torch sees no CUDA GPU" in cupy["reason"] and "CuPy" in cupy["reason"]
    factored = rep["backends"]["cupy-factored"]
    assert factored["ok"] is False and "torch sees no CUDA GPU" in factored["reason"] and "CuPy" in factored["reason"]
    assert rep["ok"] is True and rep["fixes"] == []
    # the NVRTC wheel of the test extra compiles the kernels for the GPUs we target
    assert rep["nvrtc"]["ok"] is True and rep["nvrtc"]["archs"] == [90, 80, 75]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_unusable_device_fails_with_the_reason():
    proc = _run("--device", "cuda", "--json")
    assert proc.returncode == 1
    rep = json.loads(proc.stdout)
    assert not any(b["ok"] for b in rep["backends"].values())
    assert "CUDA is not available" in rep["backends"]["torch"]["reason"]


def test_a_wrong_scan_fails_the_backend(monkeypatch):
    class Broken(TorchBackend):
        def scan(self, g, J, L_m=None):
            out = super().scan(g, J, L_m)
            out[-1] += 1e-6
            return out

    monkeypatch.setattr(doctor._backends, "get_backend", lambda name, dev: Broken())
    res = doctor.check_backend("torch", torch.device("cpu"))
    assert res["ok"] is False and "differs from the sequential scan" in res["reason"]


def test_a_backend_that_falls_back_is_not_reported_as_passing(monkeypatch):
    monkeypatch.setattr(doctor._backends, "get_backend", lambda name, dev: TorchBackend())
    res = doctor.check_backend("cpu", torch.device("cpu"))
    assert res["ok"] is False and "'torch' would run instead" in res["reason"]


def _report(**kw):
    rep = {"driver": None, "cuda_available": False, "torch": "2.13.0+cpu", "torch_cuda": None, "device": "cpu",
           "cupy": {"installed": False, "reason": "No module named 'cupy'"}, "nvrtc": {"ok": True, "reason": "ok"},
           "cpu_kernel": {"ok": True, "reason": "built"},
           "backends": {"torch": {"ok": True, "reason": ""}, "cupy": {"ok": False, "reason": "no GPU"}}}
    rep.update(kw)
    return rep


def test_fixes():
    assert doctor.fixes(_report()) == []
    (fix,) = doctor.fixes(_report(driver="535.1"))
    assert "driver 535.1" in fix and "CPU-only build" in fix and "scripts/install.sh" in fix
    gpu = dict(driver="580.1", cuda_available=True, torch="2.13.0", torch_cuda="13.0", device="cuda:0")
    (fix,) = doctor.fixes(_report(**gpu))
    assert "CuPy is not installed" in fix and ".[cuda13]" in fix
    cupy = {"installed": True, "version": "14.2.0", "cuda_runtime": "12.9", "nvrtc": "12.9"}
    fixes = doctor.fixes(_report(**gpu, cupy=cupy, backends={"torch": {"ok": True, "reason": ""},
                                                             "cupy": {"ok": False, "reason": "NVRTC error"}}))
    assert any("CuPy backend fails: NVRTC error" in f for f in fixes)
    (fix,) = doctor.fixes(_report(cpu_kernel={"ok": False, "reason": "no C compiler ('cc' not on PATH)"}))
    assert "no C compiler" in fix and "numpy path" in fix and "gcc" in fix
    assert any("CUDA 12.9 but torch for CUDA 13.0" in f for f in fixes)


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_gpu_reference_script_uses_the_install_python():
    import re

    text = (ROOT / "scripts" / "gpu_reference.sh").read_text()
    body = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    # every tool through "$PY" -m (python3 by default), never whatever `python`/`snakemake`/`bppsa` is on PATH
    assert re.search(r'^PY=\$\{PYTHON:-python3\}$', text, re.M)
    bare = [ln for ln in body if re.match(r"(python|snakemake|bppsa|pytest)\b", ln)]
    assert not bare, bare
    assert body.index(next(ln for ln in body if "bppsa doctor" in ln and ln.startswith('"$PY"'))) < \
        body.index(next(ln for ln in body if "pytest -m gpu" in ln))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that it stops where no GPU works")
def test_gpu_reference_script_stops_at_the_doctor(tmp_path):
    env = {**__import__("os").environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_reference.sh")], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 1
    assert "bppsa doctor found no backend that works on the GPU" in proc.stderr
    assert "1/5" not in proc.stdout  # nothing after the doctor ran


def test_gpu_reference_script_asks_the_workflow_only_for_targets_it_makes(tmp_path):
    """Every results/ path the script hands to snakemake is one a rule writes (a dry run on the paper profile)."""
    import re

    text = (ROOT / "scripts" / "gpu_reference.sh").read_text()
    targets = sorted({t.replace("$DEVICE", "some-gpu") for t in re.findall(r'"(results/\$DEVICE-torch-backend/[^"]+)"',
                                                                            text)})
    assert targets, "the script names no torch-backend targets any more: update this test"
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile",
                        str(ROOT / "config" / "paper.yaml"), "--directory", str(tmp_path), "--config", "backend=torch",
                        "device_slug=some-gpu-torch-backend", "device=cpu", "--", *targets],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    for t in targets:
        assert t in r.stdout
