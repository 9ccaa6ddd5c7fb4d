"""One place per extension point: a backend, a figure and a claim are each declared once, and
everything that lists them is derived from that declaration or held to it here."""
import re
import subprocess
import sys
from pathlib import Path

import yaml

from bppsa import doctor
from bppsa.backends import BACKENDS, CUPY_BACKENDS
from bppsa.backends.cuda import cost_model
from bppsa.plots import registry
from bppsa.plots.registry import Figure, Output

ROOT = Path(__file__).resolve().parents[1]


# -- backends ------------------------------------------------------------------------------------------
def test_backends_is_the_one_list():
    """The config schema's enum, doctor's checks, the cost model and config/README.md name exactly BACKENDS."""
    schema = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert schema["properties"]["backend"]["enum"] == list(BACKENDS)
    assert set(doctor.CHECKED) == set(BACKENDS) - {"auto"}
    # every backend that is neither the reference twin nor the CPU path runs on the GPU: the cost model must
    # know which layout each runs, and no more
    gpu = set(BACKENDS) - {"auto", "torch", "cpu"}
    assert set(CUPY_BACKENDS) == gpu
    assert {backend for _, backend in cost_model.LAYOUT_OF} == gpu
    assert set(cost_model.LAYOUT_OF.values()) == set(cost_model.LAYOUTS)
    readme = (ROOT / "config" / "README.md").read_text()
    (cell,) = re.findall(r"`backend` \(([^)]*)\)", readme)
    assert re.findall(r"`([\w-]+)`", cell) == list(BACKENDS)


# -- figures -------------------------------------------------------------------------------------------
DUMMY_MODULE = '''
from pathlib import Path


def draw(results, inputs, outputs):
    (out,) = outputs
    Path(out).write_text(f"{results} {' '.join(map(str, inputs))}")
'''


def _dummy(tmp_path):
    """A figure drawn by a module of tmp_path, reading this device's RNN speedups."""
    (tmp_path / "dummy_figure.py").write_text(DUMMY_MODULE)
    return Figure("dummy", "a figure registered by a test", "dummy_figure:draw", ("rnn/speedups.csv",),
                  (Output("results/fig_dummy.txt"),))


def test_a_figure_is_one_declaration(tmp_path, monkeypatch):
    """A figure registered in bppsa.plots.registry, and nowhere else, is a choice of `bppsa plot`, a rule of the
    DAG and an input of the report."""
    from bppsa.cli import build_parser, main

    dummy = _dummy(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.FIGURES, "dummy", dummy)
    parser = build_parser("plot")
    assert "dummy" in parser._subparsers._group_actions[0].choices["plot"]._actions[1].choices
    out = tmp_path / "fig_dummy.txt"
    assert main(["plot", "dummy", "--results", "somewhere", "--input", "a.csv", "--out", str(out)]) == 0
    assert out.read_text() == "somewhere a.csv"

    # the DAG of the .test configuration, with the dummy registered in the process that parses the Snakefile
    code = ("import sys\n"
            f"sys.path.insert(0, {str(tmp_path)!r})\n"
            "from bppsa.plots.registry import FIGURES, Figure, Output\n"
            f"FIGURES['dummy'] = {dummy!r}\n"
            "from snakemake.cli import main\n"
            f"main(['-n', '-p', '--cores', '1', '--configfile', '.test/config/config.yaml', '--directory', "
            f"{str(tmp_path / 'run')!r}, 'all'])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    jobs = {m[1]: m[2] for m in re.finditer(r"^(?:local)?rule (\w+):\n((?:    .*\n)*)", r.stdout, re.M)}
    rule = jobs["dummy_plot"]
    assert "input: results/cpu/rnn/speedups.csv\n" in rule and "output: results/fig_dummy.txt\n" in rule
    assert ("bppsa plot dummy --results results --input results/cpu/rnn/speedups.csv --out results/fig_dummy.txt "
            "2> logs/dummy_plot.log") in r.stdout
    for consumer in ("report_render", "all"):
        (inputs,) = re.findall(r"input: (.*)", jobs[consumer])
        assert "results/fig_dummy.txt" in inputs.split(", "), consumer


def test_a_figure_is_drawn_where_what_it_reads_is_measured():
    """No figure repeats a profile key: the CPU scaling figure is drawn for each model whose scaling.csv this
    configuration measures, the others where their files are measured, into this run's device folder."""
    scaling, table1 = registry.FIGURES["cpu_scaling"], registry.FIGURES["table1"]
    measured = ["results/cpu/gru/scaling.csv", "results/cpu/rnn/speed.csv", "results/cpu/jacobians/table1_timings.csv"]
    assert scaling.instances(measured, "results/cpu") == [{"model": "gru"}]
    assert scaling.paths("cpu", model="gru") == ["results/cpu/fig_scaling_gru.png",
                                                 "results/cpu/gru/scaling_crossover.csv"]
    assert scaling.inputs(measured, "results/cpu", model="gru") == ["results/cpu/gru/scaling.csv"]
    assert scaling.instances(measured[1:], "results/cpu") == []
    assert scaling.log == "logs/cpu_scaling_plot/{model}.log"
    assert table1.instances(measured, "results/cpu") == [{}]
    assert table1.inputs(measured, "results/cpu") == ["results/cpu/jacobians/table1_timings.csv"]
    assert registry.FIGURES["rnn"].instances(measured, "results/cpu") == []


def test_every_caption_is_declared_once_and_exists():
    captions = [o.caption for f in registry.FIGURES.values() for o in f.outputs if o.caption]
    report = (ROOT / "workflow" / "rules" / "report.smk").read_text()
    files = {p.name for p in (ROOT / "workflow" / "report").glob("*.rst")} - {"workflow.rst"}
    assert sorted(set(captions)) == sorted(f for f in files if f not in report)
    paths = [o.path for f in registry.FIGURES.values() for o in f.outputs]
    assert len(set(paths)) == len(paths)  # no two rules write one file
