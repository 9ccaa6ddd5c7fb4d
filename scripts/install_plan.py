#!/usr/bin/env python3
"""Which torch and CuPy builds ``scripts/install.sh`` installs on this machine.

Standard library only, and no side effects on import, so that the tests can feed it fake machines
(an ``nvidia-smi`` driver version, an installed torch and its CUDA version, installed CuPy wheels)
and check the packages it chooses without installing anything.

The rules:

* the CUDA major version comes from ``BPPSA_TORCH_CUDA`` (``cpu``, ``12`` or ``13``; for image
  builds, which have no GPU), else from a CUDA build of torch that is already installed (kept,
  if the driver can run it), else from the driver that ``nvidia-smi`` reports: CUDA 13 builds
  need a driver >= 580, CUDA 12 builds >= 525.60;
* torch 2.13's CUDA 13 builds come from the default index (PyPI serves them), its CUDA 12 builds
  from pytorch.org's cu129 index; a CPU-only torch on a GPU machine is replaced; without a GPU
  torch is installed only when missing (``TORCH_SPEC``), as before;
* CuPy is the wheel of torch's CUDA major (``cupy-cuda12x`` or ``cupy-cuda13x``) with the NVRTC
  wheel of the same major (CuPy compiles the kernels at run time with it); any other CuPy wheel
  is removed first, because two of them overwrite each other's ``cupy`` package.

``python3 scripts/install_plan.py`` prints the plan as bash assignments for install.sh to eval;
``--check CUDA GPU`` checks torch after the install and exits non-zero with the reason.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

TORCH_VERSION = "2.13.0"
# Oldest driver for each CUDA major: 580 for CUDA 13; 525.60.13 for CUDA 12 (minor-version
# compatibility: cubins built by any CUDA 12.x toolkit load on it).
MIN_DRIVER = {13: (580,), 12: (525, 60, 13)}
TORCH_INDEX = {13: None, 12: "https://download.pytorch.org/whl/cu129"}  # None: the configured index
# What CuPy needs at run time besides the driver: its runtime is linked in, NVRTC is loaded from
# these wheels.  pyproject.toml's cuda12 / cuda13 extras list the same (a test holds them equal).
GPU_PACKAGES = {
    12: ["cupy-cuda12x>=14", "nvidia-cuda-nvrtc-cu12==12.*"],
    13: ["cupy-cuda13x>=14", "nvidia-cuda-nvrtc==13.*"],
}
CUPY = {major: pkgs[0].split(">")[0] for major, pkgs in GPU_PACKAGES.items()}  # distribution names
FORCED = ("cpu", "12", "13")


class PlanError(Exception):
    """The machine cannot get a working install; the message says what to change."""


@dataclass
class Machine:
    forced: str | None = None          # BPPSA_TORCH_CUDA, if set
    driver: str | None = None          # e.g. "580.65.06"; None: no NVIDIA GPU visible
    torch: str | None = None           # installed torch version; None: not installed
    torch_cuda: str | None = None      # torch.version.cuda of that torch; None: a CPU build
    cupy: list[str] = field(default_factory=list)  # installed CuPy distributions


@dataclass
class Plan:
    cuda: int | None                   # CUDA major of the install; None: CPU only
    torch_uninstall: bool = False      # remove the installed torch first (wrong build)
    torch_args: list[str] = field(default_factory=list)  # pip install arguments; empty: keep torch
    cupy_uninstall: list[str] = field(default_factory=list)
    gpu_args: list[str] = field(default_factory=list)    # pip install arguments for CuPy + NVRTC
    need_gpu: bool = False             # torch must see the GPU after the install (not for image builds)
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        def arr(name, items):
            return f"{name}=({' '.join(shlex.quote(i) for i in items)})"

        return "\n".join([
            f"PLAN_CUDA={self.cuda or 'cpu'}",
            f"PLAN_TORCH_UNINSTALL={int(self.torch_uninstall)}",
            arr("PLAN_TORCH_ARGS", self.torch_args),
            arr("PLAN_CUPY_UNINSTALL", self.cupy_uninstall),
            arr("PLAN_GPU_ARGS", self.gpu_args),
            f"PLAN_NEED_GPU={int(self.need_gpu)}",
            arr("PLAN_NOTES", self.notes),
        ])


def parse_driver(text: str) -> tuple[int, ...]:
    """'580.65.06' -> (580, 65, 6); the first line wins (one line per GPU, all the same driver)."""
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    try:
        return tuple(int(p) for p in first.split("."))
    except ValueError:
        raise PlanError(f"cannot read the NVIDIA driver version from nvidia-smi's output: {text.strip()!r}") from None


def cuda_major(version: str | None) -> int | None:
    return int(version.split(".")[0]) if version else None


def plan(m: Machine, env: dict[str, str] | None = None) -> Plan:
    env = os.environ if env is None else env
    if m.forced is not None and m.forced not in FORCED:
        raise PlanError(f"BPPSA_TORCH_CUDA={m.forced!r}: choose one of {', '.join(FORCED)}")
    have = cuda_major(m.torch_cuda) if m.torch else None
    notes = []
    if m.forced is not None:
        cuda = None if m.forced == "cpu" else int(m.forced)
        notes.append(f"BPPSA_TORCH_CUDA={m.forced}: nvidia-smi not consulted")
    elif m.driver is None:
        cuda = None
    else:
        drv = parse_driver(m.driver)
        if have is not None:
            if have not in MIN_DRIVER:
                raise PlanError(f"the installed torch {m.torch} is a CUDA {m.torch_cuda} build, which this install "
                                f"does not pair with CuPy; uninstall it (pip uninstall torch) and run again")
            if drv < MIN_DRIVER[have]:
                raise PlanError(
                    f"the installed torch {m.torch} is a CUDA {m.torch_cuda} build, which needs an NVIDIA driver >= "
                    f"{_fmt(MIN_DRIVER[have])}, but this machine's driver is {m.driver.strip()}: upgrade the driver, "
                    f"or replace torch with a CUDA 12 build "
                    f"(pip uninstall -y torch, then BPPSA_TORCH_CUDA=12 bash scripts/install.sh)")
            cuda = have
            notes.append(f"keeping torch {m.torch} (CUDA {m.torch_cuda})")
        elif drv >= MIN_DRIVER[13]:
            cuda = 13
        elif drv >= MIN_DRIVER[12]:
            cuda = 12
            notes.append(f"driver {m.driver.strip()} < {_fmt(MIN_DRIVER[13])}: CUDA 12 build of torch")
        else:
            raise PlanError(f"NVIDIA driver {m.driver.strip()} is too old for torch {TORCH_VERSION} "
                            f"(its CUDA 12 builds "
                            f"need >= {_fmt(MIN_DRIVER[12])}): upgrade the driver, or install without the GPU "
                            f"(BPPSA_TORCH_CUDA=cpu bash scripts/install.sh)")
    p = Plan(cuda=cuda, notes=notes, need_gpu=cuda is not None and m.forced is None)
    spec = env.get("TORCH_SPEC") or f"torch=={TORCH_VERSION}"
    if cuda is None:
        if m.torch is None:  # today's CPU path: whatever TORCH_SPEC resolves to (a local CPU wheel here)
            p.torch_args = [spec]
        return p
    if m.torch is not None and have != cuda:
        p.torch_uninstall = True
        p.notes.append(f"replacing torch {m.torch} ({'CPU build' if have is None else 'CUDA ' + str(m.torch_cuda)}) "
                       f"with a CUDA {cuda} build")
    if m.torch is None or p.torch_uninstall:
        index = env.get("TORCH_INDEX_URL") or TORCH_INDEX[cuda]
        p.torch_args = [spec] + (["--index-url", index] if index else [])
    p.cupy_uninstall = sorted(d for d in m.cupy if d != CUPY[cuda])
    cupy, nvrtc = GPU_PACKAGES[cuda]
    p.gpu_args = [env.get("CUPY_SPEC") or cupy, nvrtc]
    return p


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


# -- probing the real machine (not used by the tests) ----------------------------------------------
def probe(env: dict[str, str] | None = None) -> Machine:
    env = os.environ if env is None else env
    forced = env.get("BPPSA_TORCH_CUDA") or None
    m = Machine(forced=forced)
    if forced is None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=60)
            if out.returncode == 0 and out.stdout.strip():
                m.driver = out.stdout
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import torch

        m.torch, m.torch_cuda = torch.__version__, torch.version.cuda
    except Exception:  # noqa: BLE001 - a torch that does not import is as good as none
        m.torch = None
    from importlib import metadata

    m.cupy = sorted({(d.metadata["Name"] or "").lower() for d in metadata.distributions()
                     if (d.metadata["Name"] or "").lower().startswith("cupy")})
    return m


def check(cuda: str, need_gpu: bool) -> str | None:
    """After the install: the reason torch does not match the plan, or None."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"torch does not import after the install: {exc}"
    if cuda == "cpu":
        return None
    if cuda_major(torch.version.cuda) != int(cuda):
        got = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU build)"
        return (f"torch {torch.__version__} has {got}, but a CUDA {cuda} build was planned; pip probably preferred "
                f"another wheel (a local CPU wheel, a pip constraint or find-links): install the CUDA {cuda} build "
                f"of torch {TORCH_VERSION} by hand, then run this script again")
    if need_gpu and not torch.cuda.is_available():
        try:
            torch.cuda.init()
            why = "torch.cuda.is_available() is False"
        except Exception as exc:  # noqa: BLE001 - its message is the reason
            why = str(exc).strip().splitlines()[0]
        return (f"nvidia-smi sees a GPU but torch {torch.__version__} (CUDA {torch.version.cuda}) "
                f"cannot use it: {why}. "
                f"Check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES, and that no other torch shadows this one")
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        why = check(argv[1], argv[2] == "1")
        if why:
            print(f"[install] error: {why}", file=sys.stderr)
            return 1
        return 0
    try:
        print(plan(probe()).shell())
    except PlanError as exc:
        print(f"[install] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
