"""scripts/install_plan.py: which torch / CuPy builds the install picks, on fake machines.

Nothing is installed: the planner is fed an nvidia-smi driver version, an installed torch and its
CUDA version, and installed CuPy wheels, and the chosen pip arguments are checked.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("install_plan", ROOT / "scripts" / "install_plan.py")
ip = importlib.util.module_from_spec(_spec)
sys.modules["install_plan"] = ip  # dataclasses look their module up by name
_spec.loader.exec_module(ip)

ENV: dict[str, str] = {}  # no TORCH_SPEC / TORCH_INDEX_URL / CUPY_SPEC overrides
CU12_INDEX = "https://download.pytorch.org/whl/cu129"


def _plan(**kw):
    return ip.plan(ip.Machine(**kw), ENV)


def test_no_gpu_keeps_todays_cpu_path():
    p = _plan(driver=None, torch=None)
    assert (p.cuda, p.torch_args, p.gpu_args, p.need_gpu, p.torch_uninstall) == (
        None, ["torch==2.13.0"], [], False, False)
    # torch already there (any build): nothing to install, no CuPy
    p = _plan(driver=None, torch="2.13.0+cpu", torch_cuda=None, cupy=["cupy-cuda12x"])
    assert (p.torch_args, p.gpu_args, p.cupy_uninstall, p.torch_uninstall) == ([], [], [], False)
    # TORCH_SPEC still chooses the CPU build, as before
    p = ip.plan(ip.Machine(), {"TORCH_SPEC": "torch==2.12.0"})
    assert p.torch_args == ["torch==2.12.0"]


@pytest.mark.parametrize("driver", ["580.65.06", "580.65.06\n580.65.06\n", "595.12"])
def test_driver_580_or_newer_gets_cuda13(driver):
    p = _plan(driver=driver, torch=None)
    assert p.cuda == 13 and p.need_gpu
    assert p.torch_args == ["torch==2.13.0"]  # the default index serves the CUDA 13.0 build
    assert p.gpu_args == ["cupy-cuda13x>=14", "nvidia-cuda-nvrtc==13.*"]


@pytest.mark.parametrize("driver", ["575.57.08", "535.104.05", "525.60.13"])
def test_driver_older_than_580_gets_cuda12(driver):
    p = _plan(driver=driver, torch=None)
    assert p.cuda == 12 and p.need_gpu
    assert p.torch_args == ["torch==2.13.0", "--index-url", CU12_INDEX]
    assert p.gpu_args == ["cupy-cuda12x>=14", "nvidia-cuda-nvrtc-cu12==12.*"]
    assert any("CUDA 12" in n for n in p.notes)


def test_driver_too_old_for_any_build_stops():
    with pytest.raises(ip.PlanError, match=r"470\.82\.01 is too old.*525\.60\.13.*BPPSA_TORCH_CUDA=cpu"):
        _plan(driver="470.82.01", torch=None)


def test_existing_cuda12_torch_is_kept_and_gets_cupy_cuda12x():
    # even on a driver that could run CUDA 13: a working CUDA build is never replaced
    for driver in ("560.35.03", "580.65.06"):
        p = _plan(driver=driver, torch="2.13.0+cu129", torch_cuda="12.9", cupy=["cupy-cuda13x"])
        assert p.cuda == 12 and p.torch_args == [] and not p.torch_uninstall
        assert p.gpu_args[0] == "cupy-cuda12x>=14"
        assert p.cupy_uninstall == ["cupy-cuda13x"]  # two CuPy wheels would overwrite each other


def test_existing_cuda13_torch_is_kept_and_gets_cupy_cuda13x():
    p = _plan(driver="580.82.07", torch="2.13.0", torch_cuda="13.0", cupy=["cupy-cuda12x", "cupy-cuda13x"])
    assert (p.cuda, p.torch_args, p.torch_uninstall) == (13, [], False)
    assert p.gpu_args[0] == "cupy-cuda13x>=14" and p.cupy_uninstall == ["cupy-cuda12x"]


def test_existing_cuda13_torch_on_an_old_driver_stops_with_the_fix():
    with pytest.raises(ip.PlanError, match=r"CUDA 13\.0 build.*>= 580.*570\.86\.15.*BPPSA_TORCH_CUDA=12"):
        _plan(driver="570.86.15", torch="2.13.0", torch_cuda="13.0")


def test_cpu_torch_on_a_gpu_machine_is_replaced():
    p = _plan(driver="580.65.06", torch="2.13.0+cpu", torch_cuda=None)
    assert p.cuda == 13 and p.torch_uninstall and p.torch_args == ["torch==2.13.0"]


@pytest.mark.parametrize("forced,cuda,torch_args", [
    ("cpu", None, ["torch==2.13.0"]),
    ("12", 12, ["torch==2.13.0", "--index-url", CU12_INDEX]),
    ("13", 13, ["torch==2.13.0"]),
])
def test_forced_choice_ignores_nvidia_smi(forced, cuda, torch_args):
    # an image build: no GPU, no driver; the driver value must not matter either
    for driver in (None, "470.1"):
        p = _plan(forced=forced, driver=driver, torch=None)
        assert (p.cuda, p.torch_args, p.need_gpu) == (cuda, torch_args, False)
        assert bool(p.gpu_args) == (cuda is not None)


def test_forced_major_replaces_a_torch_of_the_other_major():
    p = _plan(forced="12", torch="2.13.0", torch_cuda="13.0", cupy=["cupy-cuda13x"])
    assert p.torch_uninstall and p.torch_args[-1] == CU12_INDEX and p.cupy_uninstall == ["cupy-cuda13x"]
    p = _plan(forced="13", torch="2.13.0", torch_cuda="13.0")
    assert not p.torch_uninstall and p.torch_args == []


def test_bad_forced_value_and_unreadable_driver():
    with pytest.raises(ip.PlanError, match="BPPSA_TORCH_CUDA='11'"):
        _plan(forced="11")
    with pytest.raises(ip.PlanError, match="cannot read the NVIDIA driver version"):
        _plan(driver="NVIDIA-SMI has failed")


def test_overrides():
    env = {"TORCH_INDEX_URL": "https://example.invalid/cu126", "CUPY_SPEC": "cupy-cuda12x==14.1.0"}
    p = ip.plan(ip.Machine(driver="550.1"), env)
    assert p.torch_args == ["torch==2.13.0", "--index-url", "https://example.invalid/cu126"]
    assert p.gpu_args == ["cupy-cuda12x==14.1.0", "nvidia-cuda-nvrtc-cu12==12.*"]


def test_pyproject_gpu_extras_match_the_plan():
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cuda12"] == ip.GPU_PACKAGES[12]
    assert extras["cuda13"] == ip.GPU_PACKAGES[13]
    assert "gpu" not in extras  # a CuPy without a CUDA major could sit next to the other one


def _bash_plan(plan) -> dict[str, list[str]]:
    """What install.sh sees after `eval` of the plan (arrays included)."""
    script = plan.shell() + "\nfor v in PLAN_CUDA PLAN_TORCH_UNINSTALL PLAN_NEED_GPU; do echo \"$v=${!v}\"; done\n" + \
        "for a in PLAN_TORCH_ARGS PLAN_GPU_ARGS PLAN_CUPY_UNINSTALL; do n=$a[@]; printf '%s' \"$a=\"; " \
        "printf '%s|' \"${!n}\"; echo; done\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_shell_output_round_trips_through_bash():
    got = _bash_plan(_plan(driver="560.1", torch="2.13.0+cpu", torch_cuda=None, cupy=["cupy-cuda13x"]))
    assert got["PLAN_CUDA"] == "12" and got["PLAN_TORCH_UNINSTALL"] == "1" and got["PLAN_NEED_GPU"] == "1"
    assert got["PLAN_TORCH_ARGS"] == f"torch==2.13.0|--index-url|{CU12_INDEX}|"
    assert got["PLAN_GPU_ARGS"] == "cupy-cuda12x>=14|nvidia-cuda-nvrtc-cu12==12.*|"
    assert _bash_plan(_plan())["PLAN_CUDA"] == "cpu"


def test_script_on_this_machine_and_forced(tmp_path):
    """The real probe: BPPSA_TORCH_CUDA skips nvidia-smi (a fake one that fails proves it)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'should not be called' >&2\nexit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "BPPSA_TORCH_CUDA": "cpu"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_plan.py")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PLAN_CUDA=cpu" in out.stdout and "should not be called" not in out.stderr
    # unforced, with a fake nvidia-smi that reports a driver >= 580
    fake.write_text("#!/bin/sh\necho 580.65.06\n")
    env.pop("BPPSA_TORCH_CUDA")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_plan.py")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PLAN_CUDA=13" in out.stdout and "PLAN_NEED_GPU=1" in out.stdout


def test_check_after_install_on_this_machine():
    import torch

    assert ip.check("cpu", False) is None
    if torch.version.cuda is None:
        why = ip.check("13", False)
        assert why and "no CUDA (a CPU build)" in why and "CUDA 13 build was planned" in why
