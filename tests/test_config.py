"""Bad configuration is rejected before any job runs, naming the key."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(tmp_path, mutate):
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    mutate(cfg)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(path),
                           "--directory", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _validate(cfg):
    """What workflow/rules/checks.smk does first: the config against every schema, in the same order."""
    from snakemake.utils import validate

    for schema in sorted((ROOT / "workflow" / "schemas").glob("*.schema.yaml")):
        validate(cfg, str(schema))


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c["rnn"].__setitem__("seq_lens", [10, -5]), "seq_lens"),
    (lambda c: c.__setitem__("backend", "tpu"), "backend"),
    (lambda c: c["rnn"].__setitem__("lenghts", [3]), "lenghts"),
    (lambda c: c.__setitem__("dtpye", "float32"), "dtpye"),
    (lambda c: c["bench"].__setitem__("min_iters", 0), "min_iters"),
    (lambda c: c["bench"].__setitem__("iters", 10), "iters"),
    (lambda c: c["rnn"]["curves"].__setitem__("also_dtypes", ["float16"]), "also_dtypes"),
    (lambda c: c["rnn"]["curves"].__setitem__("compiled_forward", "yes"), "compiled_forward"),
    (lambda c: c["gru"]["curves"].__setitem__("compiled_forward_sets", ["xl"]), "compiled_forward_sets"),
    (lambda c: c["rnn"]["speed"].__setitem__("step_batches", [0]), "step_batches"),
    (lambda c: c["gru"]["speed"].__setitem__("step_batchs", [16]), "step_batchs"),
])
def test_schema_rejects_and_names_the_key(mutate, key):
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    _validate(cfg)  # the default passes
    mutate(cfg)
    with pytest.raises(Exception) as err:
        _validate(cfg)
    assert key in str(err.value), str(err.value)[-2000:]


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c["rnn"].__setitem__("lenghts", [3]), "lenghts"),
    # passes the schema, caught by the protocol's own check before any job
    (lambda c: c["bench"].update(min_iters=50, max_iters=20), "bench.max_iters"),
    # passes the schema, caught by checks.smk: a compiled-forward curve needs its set's other curves
    (lambda c: c["gru"]["curves"].update(sets=["s"], compiled_forward_sets=["l"]), "gru.curves.compiled_forward_sets"),
])
def test_a_bad_config_stops_snakemake_before_any_job_naming_the_key(tmp_path, mutate, key):
    r = _dry_run(tmp_path, mutate)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert key in out, out[-2000:]
    assert not (tmp_path / "results").exists() and not (tmp_path / "data").exists()


def test_both_profiles_validate_and_list_the_paper_grid(tmp_path):
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile",
                        str(ROOT / "config" / "paper.yaml"), "--directory", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    for T in (10, 30, 100, 300, 1000, 3000, 10000, 30000):
        assert f"bench_T{T}_B16.csv" in out
    for B in (2, 4, 8, 16, 32, 64, 128, 256):
        assert f"bench_T1000_B{B}.csv" in out
    assert "--variants baseline bppsa-paper bppsa-fused" in out or "bppsa-paper" in out
    assert "speedups.csv" in out and "claims.md" in out
    assert "fig_8_b.png" in out and "fig_7.png" in out
    # Fig 7's two curves, and their float64 twins; BPPSA with the compiled forward beside them in a CPU folder only
    for v in ("baseline", "bppsa-paper"):
        assert f"curve_{v}.csv" in out and f"curve_{v}_float64.csv" in out
    from bppsa import device

    cpu = device.slug("auto") == "cpu"
    assert ("curve_bppsa-paper-compiled.csv" in out) == cpu and "curve_bppsa-paper-compiled_float64.csv" not in out
    assert all((f"curve_{s}_bppsa-fused-compiled.csv" in out) == cpu for s in "sml")


def test_config_readme_names_every_key_of_the_schemas():
    """config/README.md lists every section and key the schemas define, so it cannot fall behind them."""
    import glob

    text = Path(ROOT, "config", "README.md").read_text()
    missing = []
    for f in glob.glob(str(Path(ROOT, "workflow", "schemas", "*.schema.yaml"))):
        for key, spec in yaml.safe_load(Path(f).read_text()).get("properties", {}).items():
            names = [key] + list((spec.get("properties") or {}).keys())
            missing += [f"{key}.{n}" if n != key else key for n in names if f"`{n}`" not in text]
    assert not missing, f"config/README.md does not name: {missing}"
