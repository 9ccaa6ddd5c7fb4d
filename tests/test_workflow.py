"""The whole DAG end to end on the `.test` configuration, run once for this module: the RNN part checked
(data -> verify -> bench -> speedups -> figures -> report and claims), and `snakemake --report` of the run:
one HTML file with every figure, its caption and the claims table."""
import base64
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

# one worker takes the whole file (--dist loadgroup): the one whole-DAG run (resumed_run) is built once
pytestmark = pytest.mark.xdist_group("test_workflow")
ROOT = Path(__file__).resolve().parents[1]


def _dry_run(tmp_path, mutate=lambda c: None):
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    mutate(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1", "--configfile", str(path),
                        "--directory", str(tmp_path), "results/fig_7.png"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r.stdout + r.stderr


def _train_commands(out):
    return [line[line.index("bppsa train "):] for line in out.splitlines() if "bppsa train " in line]


def test_fig_7_curves_are_trained_in_the_workflow_dtype_and_in_float64(tmp_path):
    """The default: the two curves in float32 under their old names, and again in float64 beside them; BPPSA with
    the compiled forward (rnn.curves.compiled_forward), a variant of its own, in float32 only."""
    cmds = _train_commands(_dry_run(tmp_path, lambda c: c.update(device="cpu")))  # the compiled one: CPU folders
    by_out = {c.split("--out ")[1].split()[0].rsplit("/", 1)[1]: c for c in cmds}
    assert sorted(by_out) == ["curve_baseline.csv", "curve_baseline_float64.csv", "curve_bppsa-fused-compiled.csv",
                              "curve_bppsa-fused.csv", "curve_bppsa-fused_float64.csv"]
    compiled = by_out.pop("curve_bppsa-fused-compiled.csv")
    # the same run as the paper's BPPSA curve but for its forward; every other curve runs torch's (the default)
    strip_out = lambda c: c.split(" --out ")[0]  # noqa: E731
    assert strip_out(compiled) == strip_out(by_out["curve_bppsa-fused.csv"]).replace(
        "--layout fused", "--layout fused --forward auto")
    assert not any("--forward" in c for c in by_out.values())
    for name, cmd in by_out.items():
        dtype = "float64" if name.endswith("_float64.csv") else "float32"
        assert f"--dtype {dtype} " in cmd and cmd.count("--dtype") == 1, cmd
        # the twin differs in nothing else: the same data, method, backend, epochs, lr, seed
        twin = by_out[name.replace("_float64", "")] if dtype == "float64" else None
        if twin:
            strip = lambda c: c.replace("--dtype float64", "").replace("--dtype float32", "").split(" --out ")[0]  # noqa: E731
            assert strip(cmd) == strip(twin)


def test_no_twin_without_also_dtypes_or_in_the_workflow_dtype(tmp_path):
    cmds = _train_commands(_dry_run(tmp_path, lambda c: (c.update(device="cpu"),
                                                         c["rnn"]["curves"].update(also_dtypes=[]))))
    assert len(cmds) == 3 and all("--dtype float32" in c for c in cmds)  # baseline, BPPSA, BPPSA compiled forward
    cmds = _train_commands(_dry_run(tmp_path, lambda c: c.update(device="cpu", dtype="float64")))
    assert len(cmds) == 3 and all("--dtype float64" in c and "_float64.csv" not in c for c in cmds)
    cmds = _train_commands(_dry_run(tmp_path, lambda c: (c.update(device="cpu"),
                                                         c["rnn"]["curves"].update(compiled_forward=False))))
    assert len(cmds) == 4 and not any("compiled" in c for c in cmds)


TEST_CONFIG = ROOT / ".test" / "config" / "config.yaml"


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The .test run, killed mid-job and resumed: the folder and what the kill left."""
    run: Path
    lock_left: bool  # the killed run's lock was still there
    report_before: bool  # report.md existed when the run was killed (it must not: the run was mid-way)
    resume_output: str  # what the resuming command printed


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory):
    """`snakemake all` on the .test configuration in a fresh folder, with the README's command (2 cores: about 2-4
    min): SIGKILL to the whole run (what a lost node or a walltime does) while a timing job runs, after the first
    benchmark CSV was written, then the README's line on resuming, run as written, finishes it.  The one whole-DAG
    run of the suite: every test of this file reads it.  Session-scoped: a worker of ``-n auto`` may run other
    modules' tests between these, which would tear a module fixture down."""
    import os
    import signal
    import time

    run = tmp_path_factory.mktemp("test_run")
    cmd = _readme_resume_command()
    assert cmd[0] == "snakemake"
    argv = [sys.executable, "-m", *cmd, "--configfile", str(TEST_CONFIG), "--directory", str(run), "all"]
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    incomplete = run / ".snakemake" / "incomplete"
    deadline = time.time() + 1200
    try:  # mid-job: some jobs done (bench CSVs written), one running (its outputs marked incomplete)
        while time.time() < deadline and p.poll() is None:
            done = list((run / "results").rglob("bench_*.csv")) if (run / "results").is_dir() else []
            if done and incomplete.is_dir() and any(incomplete.iterdir()):
                break
            time.sleep(0.1)
        assert p.poll() is None, "the run ended before it could be killed mid-job"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    lock_left = bool(list((run / ".snakemake" / "locks").glob("*.lock")))
    report_before = (run / "results" / "report.md").exists()
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return Resumed(run, lock_left, report_before, r.stdout + r.stderr)


@pytest.fixture(scope="session")
def test_run(resumed_run):
    """The folder of the whole .test run (every experiment, figure and table, the report and the claims)."""
    return resumed_run.run


@pytest.mark.slow
@pytest.mark.dag
def test_rnn_workflow_end_to_end(test_run, tmp_path):
    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    assert cfg["rnn"]["seq_lens"] == [5, 9] and cfg["rnn"]["batches"] == [2, 4]
    targets = ["results/fig_7.png"] + [f"results/fig_8_{p}.png" for p in "abcdef"] + ["results/cpu/rnn/speedups.csv"]
    run = test_run
    for t in targets[:-1]:
        png = run / t
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    rnn = run / "results" / "cpu" / "rnn"
    bench = pd.concat(pd.read_csv(p) for p in rnn.glob("bench_*.csv"))
    assert set(bench["seq_len"]) == {5, 9} and set(bench["batch"]) == {2, 4}
    assert set(bench["profile"]) == {"test"}
    assert set(bench["variant"]) == {"baseline", "bppsa-fused", "bppsa-paper"}
    # every variant of a configuration was timed in the same rounds
    per_variant = bench.groupby(["seq_len", "batch", "variant", "mode"])["iter"].nunique()
    rounds = per_variant.groupby(["seq_len", "batch"]).nunique()
    assert (rounds == 1).all()
    sp = pd.read_csv(rnn / "speedups.csv")
    assert len(sp) == 3 * 2 * 4  # 3 (T, B) configurations x 2 BPPSA layouts x 4 phases
    assert set(sp["phase"]) == {"backward", "backward-excl-FO", "iteration", "backward-nobp"}
    ok = sp[sp["resolved"]]
    assert (ok["ci_low"] <= ok["speedup"]).all() and (ok["speedup"] <= ok["ci_high"]).all()
    assert (ok["speedup"] > 0).all()
    assert sp[~sp["resolved"]]["speedup"].isna().all()
    # every BPPSA configuration that was timed was verified first, and the check passed
    for (T, B, layout), _ in bench[bench["method"] == "bppsa"].groupby(["seq_len", "batch", "layout"]):
        assert (rnn / f"verify_T{T}_B{B}_{layout}.json").exists()
    assert not list(run.rglob("*.tmp*")), "temporary files were left behind"
    # Fig 7's curves in the workflow's dtype and their float64 twins, each naming its backend, and BPPSA with the
    # compiled forward (rnn.curves.compiled_forward, a CPU folder, the workflow's dtype only)
    curves = {p.name: pd.read_csv(p) for p in rnn.glob("curve_*.csv")}
    assert sorted(curves) == ["curve_baseline.csv", "curve_baseline_float64.csv", "curve_bppsa-fused-compiled.csv",
                              "curve_bppsa-fused.csv", "curve_bppsa-fused_float64.csv"]
    for name, c in curves.items():
        assert set(c["dtype"]) == {"float64" if "float64" in name else "float32"}
        assert c["backend"].notna().all()

    # the report renders from whatever was measured, saying what is missing: here the RNN's results alone
    from bppsa.analysis.report import build

    shutil.copytree(run / "results" / "cpu" / "rnn", tmp_path / "results" / "cpu" / "rnn")
    report = build(tmp_path / "results")
    assert "## RNN (Fig 8)" in report and "largest backward speedup" in report and "backward-nobp" in report
    assert "| cpu | rnn | float32 | cpu | fused |" in report  # the verify results, per group: auto is the fast path
    assert "No GRU benchmarks." in report

    from bppsa.analysis.claims import collect, render

    claims = collect(run / "results")
    text = render(claims)
    assert "max backward speedup (RNN)" in text and "rises with T" in text and "falls with B" in text
    # measured on a CPU: the GPU magnitudes are shown but not judged
    assert {c.verdict for c in claims if c.claim.startswith("max ")} == {"not measurable here"}
    assert any("T=1000, B=16 is not in this profile's grid" in c.reason for c in claims)
    (curve,) = [c for c in claims if c.claim == "BPPSA's training curve overlaps the baseline's (RNN)"]
    assert "in float64" in curve.measured and "BPPSA backend" in curve.measured


# every output `snakemake --report` shows, with its caption (workflow/report/) and its category
REPORT_ENTRIES = {
    "results/fig_7.png": ("fig_7.rst", "RNN (Sec 5.1)"),
    **{f"results/fig_8_{p}.png": (f"fig_8_{p}.rst", "RNN (Sec 5.1)") for p in "abcdef"},
    "results/fig_9.png": ("fig_9.rst", "GRU (Sec 5.2)"),
    "results/fig_13.png": ("fig_13.rst", "GRU (Sec 5.2)"),
    "results/fig_10.png": ("fig_10.rst", "Pruned VGG-11 (Sec 5.3)"),
    "results/fig_6.png": ("fig_6.rst", "LeNet-5 (Sec 3.5)"),
    "results/table_1_last_column.txt": ("table_1.rst", "Sparse Jacobians (Sec 3.4)"),
    "results/report.md": ("report_md.rst", "Claims and report"),
    "results/claims.md": ("claims_md.rst", "Claims and report"),
    "results/fig_workers.png": ("fig_workers.rst", "CPU benchmarks"),
    "results/fig_lbi.png": ("fig_lbi.rst", "Latent Bounded Interfaces"),
    # on a CPU machine (the folder `cpu`) only
    "results/cpu/fig_scaling_rnn.png": ("fig_scaling.rst", "CPU benchmarks"),
    "results/cpu/fig_scaling_gru.png": ("fig_scaling.rst", "CPU benchmarks"),
}


def _caption_lines(name):
    """The caption's lines as the HTML shows them (rst literals unquoted), but those with Jinja in them."""
    text = (ROOT / "workflow" / "report" / name).read_text()
    text = re.sub(r"(?<![/\w])\*([^*/]+)\*", r"\1", text.replace("``", ""))  # *emphasis*, not results/*/
    return [ln.strip().removeprefix("- ") for ln in text.splitlines() if ln.strip() and "{{" not in ln]


@pytest.mark.slow
@pytest.mark.dag
def test_snakemake_report_holds_every_figure_with_its_caption_and_the_claims(test_run):
    import html as html_lib

    (test_run / "tmp").mkdir()
    r = subprocess.run([sys.executable, "-m", "snakemake", "--report", "tmp/report.html", "--configfile",
                        str(TEST_CONFIG), "--directory", str(test_run)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "ERROR/" not in out and "WARNING/" not in out, out[-4000:]  # docutils' complaints about a caption
    assert [p.name for p in (test_run / "tmp").iterdir()] == ["report.html"]  # one self-contained file
    page = (test_run / "tmp" / "report.html").read_text()
    results = json.loads(re.search(r"var results = (\{.*?\});\s*</script>", page, re.S).group(1))
    categories = json.loads(re.search(r"var categories = (\{.*?\});\s*</script>", page, re.S).group(1))

    expected = {k: v for k, v in REPORT_ENTRIES.items() if "/cpu/" not in k or (test_run / "results/cpu").is_dir()}
    assert set(results) == set(expected)
    pngs = {str(p.relative_to(test_run)) for p in (test_run / "results").rglob("*.png")}
    assert pngs == {k for k in results if k.endswith(".png")}  # every figure the run drew is in the report
    for path, (caption, category) in expected.items():
        entry = results[path]
        # the file itself, embedded
        data = base64.b64decode(entry["data_uri"].split("base64,", 1)[1])
        assert data == (test_run / path).read_bytes(), path
        # its caption, rendered, and its category
        shown = html_lib.unescape(re.sub(r"<[^>]+>", "", entry["caption"]))
        for line in _caption_lines(caption):
            assert line.strip() in shown, (path, line)
        assert any(path in files for files in categories[category].values()), (path, category)
    scaling = results.get("results/cpu/fig_scaling_rnn.png")
    if scaling:  # the caption's Jinja filled in from the job
        assert "Backward pass of the RNN against worker threads" in scaling["caption"]
        assert "results/cpu/rnn/scaling.csv" in scaling["caption"]

    claims = base64.b64decode(results["results/claims.md"]["data_uri"].split("base64,", 1)[1]).decode()
    assert "| claim | paper value | paper device | measured | device | verdict | reason |" in claims
    assert "max backward speedup (RNN)" in claims
    # the workflow's description, with the profile filled in
    assert "BPPSA reproduction: the figures and tables" in page and "<strong>test</strong>" in page


@pytest.mark.slow
@pytest.mark.dag
def test_another_devices_folder_redraws_the_figures_that_overlay_it(test_run, tmp_path):
    """The figure, Table 1 and report rules declare what they read in other device folders: a folder
    added makes exactly the rules that read its files (and what depends on them) run again."""
    run = tmp_path / "run"
    shutil.copytree(test_run, run, symlinks=True, ignore=shutil.ignore_patterns("tmp"))

    def dry_run():
        r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile",
                            str(TEST_CONFIG), "--directory", str(run)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        return set(re.findall(r"^(?:local)?rule (\w+):", r.stdout, re.M))

    assert dry_run() == set()  # the run is complete
    other = run / "results" / "reference" / "other-gpu" / "rnn"
    other.mkdir(parents=True)
    shutil.copy(run / "results" / "cpu" / "rnn" / "speedups.csv", other)
    assert dry_run() == {"rnn_plot", "report_render", "all"}
    shutil.rmtree(run / "results" / "reference")
    (run / "results" / "h100" / "vgg11").mkdir(parents=True)
    shutil.copy(run / "results" / "cpu" / "vgg11" / "flops.csv", run / "results" / "h100" / "vgg11")
    assert dry_run() == {"vgg11_plot", "report_render", "all"}


_OPENED: list | None = None  # the files open() is given while recording (an audit hook cannot be removed)
_HOOKED = []  # the hook, once installed


def _record_opens(event, args):
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, Path)):
        _OPENED.append(Path(args[0]).resolve())


def _opens(device, fn, *args):
    """What ``fn(*args)`` opens in the folder ``device``, relative to it."""
    global _OPENED
    if _record_opens not in _HOOKED:
        sys.addaudithook(_record_opens)
        _HOOKED.append(_record_opens)
    _OPENED = []
    try:
        fn(*args)
        return {str(p.relative_to(device)) for p in _OPENED if p.is_relative_to(device)}
    finally:
        _OPENED = None


def _check_declared(name, opened, declared, device):
    """Every file opened is declared, and every declared pattern the folder has a file for was opened."""
    regex = {p: re.escape(p).replace(r"\*", "[^/]*") for p in declared}
    files = [str(f.relative_to(device)) for f in device.rglob("*") if f.is_file()]
    assert {f for f in opened if not any(re.fullmatch(r, f) for r in regex.values())} == set(), name
    present = {p for p, r in regex.items() if any(re.fullmatch(r, f) for f in files)}
    assert {p for p in present if not any(re.fullmatch(regex[p], f) for f in opened)} == set(), name


@pytest.mark.slow
@pytest.mark.dag
def test_the_report_and_the_figures_open_what_they_declare(test_run, tmp_path):
    """What the report's rule and each figure's rule declare in other device folders (REPORT_READS, the figures'
    reads) is what they open in one: each claim row, report.md's sections and each figure, run on this run's
    results, open no file their declaration misses, and every declared file the run has."""
    from bppsa.analysis import claims, report
    from bppsa.plots.registry import FIGURES

    results = (test_run / "results").resolve()
    device = results / "cpu"
    for row in claims.ROWS:
        _check_declared(row.__name__, _opens(device, row, results), row.reads, device)
    sections = [p for section in report.SECTIONS for p in section.reads]
    _check_declared("report.md", _opens(device, report.build, results), sections, device)
    measured = [str(f) for f in device.rglob("*") if f.is_file()]
    for figure in FIGURES.values():
        for wildcards in figure.instances(measured, str(device)):
            outputs = [str(tmp_path / Path(p).name) for p in figure.paths("cpu", **wildcards)]
            inputs = figure.inputs(measured, str(device), **wildcards)
            opened = _opens(device, figure.run, str(results), inputs, outputs)
            _check_declared(figure.name, opened, [p.format(**wildcards) for p in figure.reads], device)


def _readme_resume_command():
    """The README's one line on resuming a killed run, as the argument list it names."""
    import shlex

    (line,) = [ln for ln in (ROOT / "README.md").read_text().splitlines() if "killed" in ln and "resumes" in ln]
    return shlex.split(re.findall(r"`([^`]+)`", line)[-1])


def _files(run):
    """Every file a run leaves, but Snakemake's own records and other tests' scratch (tmp/)."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*")
                  if p.is_file() and p.relative_to(run).parts[0] not in (".snakemake", "tmp"))


def _planned_files(run, target):
    """The outputs and logs of every job that ``target`` needs, as ``snakemake --summary`` lists them for ``run``."""
    r = subprocess.run([sys.executable, "-m", "snakemake", "--summary", "--cores", "1", "--configfile",
                        str(TEST_CONFIG), "--directory", str(run), target],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln.split("\t") for ln in r.stdout.splitlines()[1:] if "\t" in ln]
    assert rows and all(row[4] == "ok" for row in rows), r.stdout  # the uninterrupted run made every one
    return sorted({row[0] for row in rows} | {log for row in rows for log in row[3].split(",") if log not in ("", "-")})


@pytest.mark.slow
@pytest.mark.dag
def test_a_run_killed_mid_job_resumes_with_the_readmes_line(resumed_run):
    """The kill left a lock and half-done jobs; the README's line, run as written, finished the run with exactly
    the files the DAG plans (every job's outputs and logs, nothing half-written beside them)."""
    assert resumed_run.lock_left, "a killed run leaves its lock"
    assert not resumed_run.report_before
    assert "which is no longer running" in resumed_run.resume_output  # the lock was removed, not --unlock'ed
    run = resumed_run.run
    claim = "results/cpu/hardware.json"  # the device folder's claim, written by its first job (no rule's output)
    files = _files(run)
    # the stand-in's clips, which irmas_make writes under the root its declared manifest names
    manifest = json.loads((run / "data" / "irmas" / "corpus.json").read_text())
    clips = [f for f in files if f.startswith(manifest["root"] + "/")]
    assert len([f for f in clips if f.endswith(".wav")]) == manifest["clips"] > 0
    assert [f for f in files if f not in clips] == sorted({*_planned_files(run, "all"), claim})
