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
    run = tmp_path / "run"

    def snakemake(*args):
        argv = ["--cores", "1", "--configfile", ".test/config/config.yaml", "--directory", str(run), *args]
        code = ("import sys\n"
                f"sys.path.insert(0, {str(tmp_path)!r})\n"
                "from bppsa.plots.registry import FIGURES, Figure, Output\n"
                f"FIGURES['dummy'] = {dummy!r}\n"
                "from snakemake.cli import main\n"
                f"main({argv!r})\n")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        return r.stdout

    out = snakemake("-n", "-p", "all")
    jobs = {m[1]: m[2] for m in re.finditer(r"^(?:local)?rule (\w+):\n((?:    .*\n)*)", out, re.M)}
    rule = jobs["dummy_plot"]
    assert "input: results/cpu/rnn/speedups.csv\n" in rule and "output: results/fig_dummy.txt\n" in rule
    assert ("bppsa plot dummy --results results --input results/cpu/rnn/speedups.csv --out results/fig_dummy.txt "
            "2> logs/dummy_plot.log") in out
    for consumer in ("report_render", "all"):
        (inputs,) = re.findall(r"input: (.*)", jobs[consumer])
        assert "results/fig_dummy.txt" in inputs.split(", "), consumer

    # and a figure declared before it still runs its own command (a rule's shell command is formatted when its
    # job runs, after the loop over the registry: Table 1's text from one row of measurements)
    table1 = run / "results" / "cpu" / "jacobians" / "table1_timings.csv"
    table1.parent.mkdir(parents=True)
    table1.write_text("operator,method,seconds,sparsity,sparsity_expression,mkldnn,processor,threads,profile,data\n"
                      "ReLU,analytic,0.001,0.99998,0.99998,False,x86_64,2,test,random\n")
    snakemake("results/table_1_last_column.txt", "--allowed-rules", "table1_plot")
    assert "ReLU" in (run / "results" / "table_1_last_column.txt").read_text()
