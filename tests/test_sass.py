"""The kernels' machine code (SASS), checked without a GPU: every ``.cu`` compiled by NVRTC with CuPy's options for
sm_80 and sm_90 (as ``tests/test_nvrtc.py`` does), the cubin disassembled by ``cuobjdump -sass`` (the
``nvidia-cuda-cuobjdump`` wheel of the ``test`` extra; it runs ``nvdisasm`` from the ``nvidia-cuda-nvdisasm`` wheel):

* no local-memory instruction (LDL, STL) in any kernel: no spill and no stack array survived ptxas;
* every kernel's registers within 10 % of ``tests/data/sass_kernels.json`` (the register caps, recorded per
  architecture with the static counts of shared loads and FMAs of each kernel; ``BPPSA_UPDATE_SASS_RECORD=1``
  rewrites it);
* the shared-load to FMA ratio of the register up kernel's step loop (``factored_up.cu`` at H = 20, fp32), which
  issue 32 wants at <= 0.15, and no local memory in that kernel at the register budget's edges (other H);
* a control kernel that does spill shows LDL/STL, so the check can fail.

In CI (CI=true) a missing cuobjdump or NVRTC fails these tests instead of skipping them.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from bppsa.backends.cuda import nvrtc, runtime

# one worker takes the whole file (--dist loadgroup): the kernels compiled and disassembled once (record)
pytestmark = pytest.mark.xdist_group("test_sass")
ARCHS = (80, 90)
RECORD = Path(__file__).parent / "data" / "sass_kernels.json"
REGISTER_GROWTH = 1.10


def _wheel_binary(dist: str, name: str) -> str | None:
    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        return None
    hit = next((f for f in files if f.name == name and "bin" in f.parts), None)
    return str(hit.locate()) if hit else None


def _need(what: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI must disassemble the kernels, but {what}")
    pytest.skip(what)


@pytest.fixture(scope="module")
def tools() -> dict[str, str]:
    try:
        nvrtc.version()
    except (nvrtc.NvrtcUnavailable, OSError) as exc:
        _need(f"NVRTC unavailable: {exc}")
    cuobjdump = _wheel_binary("nvidia-cuda-cuobjdump", "cuobjdump") or shutil.which("cuobjdump")
    nvdisasm = _wheel_binary("nvidia-cuda-nvdisasm", "nvdisasm") or shutil.which("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        _need("cuobjdump or nvdisasm not found (pip install -e '.[test]' brings the nvidia-cuda-cuobjdump and "
              "nvidia-cuda-nvdisasm wheels)")
    return {"cuobjdump": cuobjdump, "nvdisasm_dir": str(Path(nvdisasm).parent)}


def _disassemble(tools, cubin: bytes, tmp: Path) -> str:
    path = tmp / "k.cubin"
    path.write_bytes(cubin)
    env = {**os.environ, "NVDISASM_PATH": tools["nvdisasm_dir"],
           "PATH": tools["nvdisasm_dir"] + os.pathsep + os.environ.get("PATH", "")}
    r = subprocess.run([tools["cuobjdump"], "-sass", str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


_FUNCTION = re.compile(r"^\s*Function : (\w+)\s*$", re.M)
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*([^;]*);")


def functions(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """Kernel name -> its instructions (address, opcode without modifiers, operands)."""
    marks = list(_FUNCTION.finditer(sass))
    out = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        body = sass[m.end(): nxt.start() if nxt else len(sass)]
        out[m.group(1)] = [(int(i.group(1), 16), i.group(3), i.group(5)) for i in _INSTR.finditer(body)]
    return out


def hottest_loop(instrs) -> list[tuple[int, str, str]]:
    """The innermost loop (a backward branch's range holding no other backward branch) with the most FMAs."""
    loops = []
    for addr, op, args in instrs:
        m = re.match(r"(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", args.strip()) if op == "BRA" else None
        if m and m.group(1) and int(m.group(1), 16) <= addr:
            loops.append((int(m.group(1), 16), addr))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    best: list = []
    for a, b in inner:
        body = [x for x in instrs if a <= x[0] <= b]
        if sum(x[1] in ("FFMA", "DFMA") for x in body) > sum(x[1] in ("FFMA", "DFMA") for x in best):
            best = body
    return best


def _counts(instrs) -> dict[str, int]:
    ops = [op for _, op, _ in instrs]
    return {"lds": ops.count("LDS"), "fma": ops.count("FFMA") + ops.count("DFMA"), "ldl": ops.count("LDL"),
            "stl": ops.count("STL"), "instructions": len(ops)}


@functools.cache
def _compiled(source: str, arch: int):
    return nvrtc.compile_kernel(source, arch, "-Xptxas=-v")


@functools.cache
def _record_now(tools_key: tuple, tmp: str) -> dict:
    tools = dict(tools_key)
    rec: dict = {"nvrtc": ".".join(map(str, nvrtc.version()))}
    for arch in ARCHS:
        per = {}
        for source in runtime.SOURCES:
            r = _compiled(source, arch)
            report = nvrtc.ptxas_report(r.log)
            for name, instrs in functions(_disassemble(tools, r.cubin, Path(tmp))).items():
                loop = _counts(hottest_loop(instrs))
                per[name] = {"registers": report[name]["registers"], **_counts(instrs),
                             "loop_lds": loop["lds"], "loop_fma": loop["fma"]}
        rec[f"sm_{arch}"] = per
    return rec


@pytest.fixture(scope="module")
def record(tools, tmp_path_factory):
    got = _record_now(tuple(sorted(tools.items())), str(tmp_path_factory.mktemp("sass")))
    if os.environ.get("BPPSA_UPDATE_SASS_RECORD") == "1":
        RECORD.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_no_local_memory_in_any_kernel(record, arch):
    per = record[f"sm_{arch}"]
    from cuda_emulator import kernels_for

    assert len(per) == sum(len(kernels_for(s, runtime.reference_constants(s))) for s in _kernel_names())
    local = {name: (k["ldl"], k["stl"]) for name, k in per.items() if k["ldl"] or k["stl"]}
    assert not local, f"sm_{arch}: kernels with LDL/STL (spills or a stack array): {local}"


def _kernel_names():
    from cuda_emulator import KERNEL_NAMES

    return KERNEL_NAMES


@pytest.mark.parametrize("arch", ARCHS)
def test_registers_within_the_recorded_caps(record, arch):
    want = json.loads(RECORD.read_text())[f"sm_{arch}"]
    got = record[f"sm_{arch}"]
    assert sorted(got) == sorted(want)
    for name, g in got.items():
        assert g["registers"] <= want[name]["registers"] * REGISTER_GROWTH, (
            f"{name} on sm_{arch}: {g['registers']} registers, recorded {want[name]['registers']}; update the record")


@pytest.mark.parametrize("kernel", ["bppsa_factored_up_rnn_f32", "bppsa_factored_up_gru_f32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_up_kernel_loop_shared_loads_per_fma(record, arch, kernel):
    """Issue 32: the register up kernel (factored_up.cu at H = 20: two columns a thread in fp32) broadcasts W^T from
    shared memory 16 bytes a load, each value used for both columns: <= 0.15 shared loads per FMA in its step loop
    (5 LDS.128 per 40 FFMA for each column m of W^T).  fp64 (one column a thread, 2 doubles a load) is recorded, not
    held: about 0.5."""
    k = record[f"sm_{arch}"][kernel]
    assert k["loop_fma"] >= 20 * 20 * 2 - 40, k  # the whole step unrolled: H·H·NC FMAs (the first m multiplies)
    assert k["loop_lds"] / k["loop_fma"] <= 0.15, k


# H at the register budget's edges (plan.up_columns): fp32 with 4 columns (H = 16) and 1 (H = 40), fp64 with 2
# (H = 13); the reference H = 20 (fp64 with 1 column) is in the record
@pytest.mark.matrix  # three full compiles of the unrolled kernel (H = 40: ~35 s of ptxas): a build matrix
@pytest.mark.parametrize("H", [13, 16, 40])
def test_register_up_kernel_keeps_to_registers_at_the_budget_edges(tools, tmp_path, H):
    from bppsa.backends.cuda import plan

    r = nvrtc.compile_kernel("factored_up.cu", 90, "-Xptxas=-v", consts=plan.up_constants(H))
    report = nvrtc.ptxas_report(r.log)
    want = {f"bppsa_factored_up_{k}_{s}" for k in ("rnn", "gru") for s, it in (("f32", 4), ("f64", 8))
            if plan.up_columns(H, it)}
    assert set(report) == want and want
    for name, instrs in functions(_disassemble(tools, r.cubin, tmp_path)).items():
        c = _counts(instrs)
        assert c["ldl"] == c["stl"] == 0, (H, name, c)
        assert report[name]["spill_stores"] == report[name]["spill_loads"] == report[name]["stack"] == 0, (H, name)


def test_the_local_memory_check_can_fail(tools, tmp_path):
    src = r'''
extern "C" __global__ void k(float* o, int i) {
  float a[64];  // written and read at run-time indices: it lives in local memory
  for (int j = 0; j < 64; ++j) a[(j * i + j) & 63] = o[j] * j;
  o[0] = a[i & 63] + a[(i >> 6) & 63];
}'''
    r = nvrtc.compile_source(src, nvrtc.cupy_options(90) + ("-Xptxas=-v",))
    c = _counts(functions(_disassemble(tools, r.cubin, tmp_path))["k"])
    assert c["ldl"] > 0 and c["stl"] > 0


def test_hottest_loop_finds_the_inner_loop():
    instrs = [(0x00, "MOV", "R1, R2"), (0x10, "LDS", "R3, [R4]"), (0x20, "LDS", "R5, [R6]"),
              (0x30, "FFMA", "R7, R3, R5, R7"), (0x40, "BRA", "0x10"), (0x50, "FFMA", "R8, R8, R8, R8"),
              (0x60, "BRA", "0x00"), (0x70, "EXIT", "")]
    loop = hottest_loop(instrs)
    assert [a for a, _, _ in loop] == [0x10, 0x20, 0x30, 0x40]
    assert _counts(loop)["lds"] == 2 and _counts(loop)["fma"] == 1
