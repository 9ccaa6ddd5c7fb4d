"""The wheel closure scripts/gpu_wheels.sh fetches: the requirements given and, one package at a time (pip download
--no-deps for the GPU node's Python and platform), every dependency of a fetched wheel, except the packages the node's
image already holds (their dependencies are the node's too: torch, numpy, scipy ... are never downloaded).

Usage: python scripts/gpu_wheels.py OUT_DIR HAVE_FILE PYTHON_VERSION REQUIREMENT...
Writes OUT_DIR/*.whl and OUT_DIR/MANIFEST.txt (name==version); exits 1 naming what has no wheel."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17, 12, 5)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "any"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(req: Requirement) -> Requirement:
    """``req`` pinned to the version installed here where it satisfies it (the versions this checkout is tested
    with), else as given."""
    from importlib import metadata

    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return req
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return req
    return Requirement(f"{req.name}=={version}")


def pure_wheel(req: Requirement, out: Path) -> list[Path]:
    """The wheel of a package published only as a source distribution, built here without its dependencies; kept
    only if it is pure Python (``-none-any``), which any Python 3 platform installs."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-binary", req.name,
                            "-w", tmp, str(req)], capture_output=True, text=True)
        built = [w for w in Path(tmp).glob("*.whl") if w.name.endswith("-none-any.whl")]
        if r.returncode != 0 or not built:
            return []
        dest = out / built[0].name
        shutil.copy2(built[0], dest)
        return [dest]


def main(argv: list[str]) -> int:
    out, have_file, pyver, reqs = Path(argv[0]), Path(argv[1]), argv[2], argv[3:]
    have = {norm(x) for line in have_file.read_text().splitlines() if not line.startswith("#") for x in line.split()}
    abi = "cp" + pyver.replace(".", "")
    env = {"python_version": pyver, "python_full_version": pyver + ".3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.whl")) + [out / "MANIFEST.txt"]:
        old.unlink(missing_ok=True)
    todo = [Requirement(r) for r in reqs]
    done: set[str] = set()
    kept: dict[str, str] = {}
    missing: list[str] = []
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    while todo:
        req = todo.pop(0)
        name = norm(req.name)
        if name in done or name in have or (req.marker and not req.marker.evaluate(env)):
            continue
        done.add(name)
        req = pinned(req)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                            "--python-version", pyver, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                            "--abi", "none", *platforms, "-d", str(out), str(req)], capture_output=True, text=True)
        got = [w for w in out.glob("*.whl") if norm(w.name.split("-")[0]) == name]
        if r.returncode != 0 or not got:
            got = pure_wheel(req, out)  # a package published as source only: built here if it is pure Python
        if not got:
            missing.append(f"{req} ({(r.stderr.strip().splitlines() or ['no wheel'])[-1]})")
            continue
        whl = got[0]
        kept[name] = whl.name.split("-")[1]
        z = zipfile.ZipFile(whl)
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                dep = Requirement(line.split(":", 1)[1].strip())
                if dep.marker is None or dep.marker.evaluate(env):
                    todo.append(dep)
    (out / "MANIFEST.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(kept.items())))
    size = sum(p.stat().st_size for p in out.glob("*.whl"))
    print(f"[gpu_wheels] {len(kept)} wheels, {size / 2**20:.1f} MiB in {out}/ (the node has the rest)")
    if missing:
        print("[gpu_wheels] incomplete, no wheel for: " + "; ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
