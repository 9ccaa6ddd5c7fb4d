import json
import subprocess
import sys

import pandas as pd
import pytest

from bppsa.cli import main


def _bppsa(*args):
    return subprocess.run([sys.executable, "-m", "bppsa", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("layout", ["paper", "fused"])
def test_verify_prints_json_and_passes(dtype, layout, tmp_path):
    out = tmp_path / "v.json"
    r = _bppsa("verify", "--model", "rnn", "--seq-len", "23", "--batch", "5", "--hidden", "20", "--dtype", dtype,
               "--backend", "torch", "--layout", layout, "--seed", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    for key in ("model", "seq_len", "batch", "hidden", "dtype", "backend", "layout", "max_rel_err"):
        assert key in res
    assert (res["model"], res["seq_len"], res["batch"], res["layout"], res["dtype"]) == ("rnn", 23, 5, layout, dtype)
    assert res["max_rel_err"] <= {"float64": 1e-10, "float32": 1e-4}[dtype]
    assert json.loads(out.read_text()) == res | {"device_slug": res["device_slug"]}


def test_verify_fails_loudly_when_gradients_differ(tmp_path, monkeypatch, capsys):
    """A broken scan must make verify exit non-zero and keep no JSON."""
    import bppsa.backends as backends

    real = backends.TorchBackend.scan
    monkeypatch.setattr(backends.TorchBackend, "scan", lambda self, g, J, L_m=None: real(self, g, J, L_m) * 1.001)
    out = tmp_path / "v.json"
    rc = main(["verify", "--seq-len", "17", "--batch", "3", "--backend", "torch", "--out", str(out)])
    assert rc == 1
    assert "exceeds the float64 tolerance" in capsys.readouterr().err
    assert not out.exists()


def test_bench_and_train_write_tidy_csvs(tmp_path):
    data = tmp_path / "T37.npz"
    assert main(["make-bitstream", "--seq-len", "37", "--samples", "64", "--out", str(data)]) == 0
    bench = tmp_path / "bench.csv"
    assert main(["bench", "--data", str(data), "--batch", "8", "--warmup", "1", "--min-iters", "2", "--max-iters", "2",
                 "--min-seconds", "0", "--backend", "torch", "--variants", "baseline", "bppsa-paper",
                 "--packed-baseline", "on", "--lr", "1e-3", "--out", str(bench)]) == 0
    df = pd.read_csv(bench)
    assert set(df["method"]) == {"baseline", "bppsa"} and set(df["mode"]) == {"full", "nobp"}
    assert set(df["variant"]) == {"baseline", "baseline-packed", "bppsa-paper"}
    assert set(df["backend"]) == {"autograd", "autograd-packed", "torch"}
    assert set(df["stopped_by"]) == {"cap"} and set(df["rounds"]) == {2} and set(df["reference"]) == {"baseline"}
    full = df[df["mode"] == "full"]
    assert set(full[full["method"] == "bppsa"]["phase"]) == {"forward", "jacobian", "backward", "optimizer"}
    assert set(full[full["method"] == "baseline"]["phase"]) == {"forward", "backward", "optimizer"}
    assert set(df[df["mode"] == "nobp"]["phase"]) <= {"forward", "jacobian"}
    assert (df["seconds"] > 0).all() and set(df["seq_len"]) == {37} and set(df["batch"]) == {8}
    assert df.groupby(["variant", "mode", "phase"]).size().eq(2).all()  # one row per timed iteration

    curves = {}
    for method in ("baseline", "bppsa"):
        path = tmp_path / f"curve_{method}.csv"
        assert main(["train", "--data", str(data), "--batch", "8", "--method", method, "--epochs", "3", "--lr", "1e-2",
                     "--dtype", "float64", "--backend", "torch", "--out", str(path)]) == 0
        curves[method] = pd.read_csv(path)
    a, b = curves["baseline"], curves["bppsa"]
    assert list(a["epoch"]) == [1, 2, 3] and (a["wall_clock_s"].diff().dropna() > 0).all()
    # exact gradients, same seed and batch order: the two trainings follow the same trajectory
    assert (a["loss"] - b["loss"]).abs().max() < 1e-9
    assert (a["accuracy"] == b["accuracy"]).all()


def test_graphed_bench_on_a_cpu_is_refused_before_any_work(tmp_path, capsys):
    data = tmp_path / "T9.npz"
    assert main(["make-bitstream", "--seq-len", "9", "--samples", "8", "--out", str(data)]) == 0
    out = tmp_path / "g.csv"
    rc = main(["bench", "--data", str(data), "--batch", "4", "--lr", "1e-3", "--graphed", "--device", "cpu",
               "--out", str(out)])
    assert rc == 2
    assert "--graphed captures CUDA graphs and needs a CUDA device" in capsys.readouterr().err
    assert not out.exists()


def _bench_checked(tmp_path, variants, verify_out):
    data = tmp_path / "T37.npz"
    if not data.exists():
        assert main(["make-bitstream", "--seq-len", "37", "--samples", "16", "--out", str(data)]) == 0
    return main(["bench", "--data", str(data), "--batch", "4", "--warmup", "0", "--min-iters", "1", "--max-iters",
                 "1", "--min-seconds", "0", "--backend", "torch", "--variants", *variants, "--lr", "1e-3",
                 "--dtype", "float64", "--seed", "3", "--device-slug", "here", "--out", str(tmp_path / "b.csv"),
                 "--verify-out", *map(str, verify_out)])


def test_bench_checks_each_bppsa_variant_first_as_verify_does(tmp_path, capsys):
    """--verify-out: the bench's gradient check of each BPPSA layout writes what `bppsa verify` writes at that
    shape, one file per BPPSA variant in the order of --variants; then the timing."""
    outs = [tmp_path / "v_fused.json", tmp_path / "v_paper.json"]
    assert _bench_checked(tmp_path, ["baseline", "bppsa-fused", "bppsa-paper"], outs) == 0
    assert (tmp_path / "b.csv").exists()
    for layout, out in zip(["fused", "paper"], outs):
        alone = tmp_path / f"alone_{layout}.json"
        assert main(["verify", "--model", "rnn", "--seq-len", "37", "--batch", "4", "--backend", "torch",
                     "--layout", layout, "--dtype", "float64", "--seed", "3", "--device-slug", "here",
                     "--out", str(alone)]) == 0
        got, want = json.loads(out.read_text()), json.loads(alone.read_text())
        assert got["layout"] == layout and got["ok"] and got == want
    capsys.readouterr()
    assert _bench_checked(tmp_path, ["baseline", "bppsa-fused", "bppsa-paper"], outs[:1]) == 2  # one file, 2 variants
    assert "--verify-out: 1 file(s) for 2 BPPSA variant(s)" in capsys.readouterr().err


def test_bench_stops_before_any_timing_when_a_check_fails(tmp_path, monkeypatch, capsys):
    import bppsa.backends as backends

    real = backends.TorchBackend.scan
    monkeypatch.setattr(backends.TorchBackend, "scan", lambda self, g, J, L_m=None: real(self, g, J, L_m) * 1.001)
    out = tmp_path / "v.json"
    assert _bench_checked(tmp_path, ["baseline", "bppsa-paper"], [out]) == 1
    err = capsys.readouterr().err
    assert "paper layout at T=37, B=4: max_rel_err" in err and "exceeds the float64 tolerance" in err
    assert not out.exists() and not (tmp_path / "b.csv").exists()


def test_corrupt_dataset_error_names_the_file(tmp_path, capsys):
    bad = tmp_path / "T10.npz"
    bad.write_bytes(b"not a zip")
    rc = main(["bench", "--data", str(bad), "--batch", "2", "--lr", "1e-3", "--out", str(tmp_path / "x.csv")])
    assert rc == 2
    assert "T10.npz" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()


def test_the_command_table_is_what_the_modules_register():
    """``bppsa COMMAND`` loads only the module that :data:`bppsa.commands.MODULES` names for it: the table
    must list exactly the commands each module registers."""
    import argparse
    import importlib
    import pkgutil

    from bppsa import commands
    from bppsa.cli import build_parser
    from bppsa.cli import commands as cli_commands

    found, helps = {}, {}
    for info in pkgutil.iter_modules(commands.__path__):
        module = importlib.import_module(f"bppsa.commands.{info.name}")
        if hasattr(module, "register"):
            sub = argparse.ArgumentParser().add_subparsers()
            module.register(sub)
            found[info.name] = tuple(sub.choices)
            helps.update({a.dest: a.help for a in sub._choices_actions})
    assert found == commands.MODULES
    # `bppsa --help` lists the commands read from the source: the same names and help texts
    assert dict(cli_commands()) == helps and len(cli_commands()) == len(helps)
    every = build_parser()._subparsers._group_actions[0].choices
    assert set(every) == {c for cmds in commands.MODULES.values() for c in cmds}
    for module, cmds in commands.MODULES.items():
        assert set(build_parser(cmds[0])._subparsers._group_actions[0].choices) == set(cmds), module


def test_the_command_list_imports_no_command_module():
    """``bppsa``, ``bppsa --help`` and an unknown command answer from the list alone (~0.1 s, not ~2.5 s of torch)."""
    code = ("import sys\n"
            "from bppsa.cli import main\n"
            "for argv in (['--help'], [], ['no-such-command']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit as e:\n"
            "        print('exit', e.code)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('bppsa.commands.')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]", r.stdout
    assert "speed" in r.stdout and "exit 0" in r.stdout and r.stdout.count("exit 2") == 2
    assert "invalid choice: 'no-such-command'" in r.stderr


def test_figure_and_analysis_jobs_start_without_torch():
    """The jobs that only read CSVs (figures, Table 1's text, speedups, the report and claims), the IRMAS
    download and the bitstream sets parse their command line and load what their handlers import without
    importing torch."""
    code = ("import sys\n"
            "from bppsa.cli import build_parser\n"
            "for cmd in ('plot', 'speedups', 'report', 'make-irmas',\n"
            "            'make-bitstream', 'bench-bitstream'):\n"
            "    build_parser(cmd)\n"
            "import bppsa.plots.rnn, bppsa.plots.gru, bppsa.plots.fig10, bppsa.plots.table1, bppsa.plots.fig6\n"
            "import bppsa.analysis.cnn\n"
            "import bppsa.analysis.speedups, bppsa.analysis.report, bppsa.analysis.claims, bppsa.data.irmas\n"
            "import bppsa.data.bitstream\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("argv, name, value", [
    (["verify", "--model", "rnn", "--seq-len", "10", "--batch", "0"], "--batch", "0"),
    (["verify", "--model", "rnn", "--seq-len", "-5", "--batch", "2"], "--seq-len", "-5"),
    (["verify", "--seq-len", "10", "--batch", "2", "--hidden", "0"], "--hidden", "0"),
    (["verify", "--seq-len", "ten", "--batch", "2"], "--seq-len", "ten"),
    (["bench", "--data", "x.npz", "--batch", "-1", "--lr", "1e-3", "--out", "x.csv"], "--batch", "-1"),
    (["make-bitstream", "--seq-len", "0", "--samples", "4", "--out", "x.npz"], "--seq-len", "0"),
    (["vgg11-flops", "--data", "m.json", "--networks", "pruned", "--samples", "0", "--L-m", "2",
      "--dense-limit-gb", "1", "--out", "x.csv"], "--samples", "0"),
])
def test_size_arguments_are_positive_integers_named_by_the_parser(argv, name, value, capsys):
    """Every size argument goes through the shared ``positive_int`` type: argparse stops before any work and
    names the argument (not 'max() arg is an empty sequence' from deep inside)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {name}: must be a positive integer, got '{value}'" in err


def test_every_size_argument_uses_the_shared_type():
    """No size argument of any command is parsed by a bare ``int`` (which lets 0 and -5 through)."""
    import argparse
    import importlib

    from bppsa import commands
    from bppsa.commands.argtypes import positive_int

    sizes = {"--seq-len", "--seq-lens", "--batch", "--batches", "--batch-size", "--hidden", "--input-size",
             "--samples", "--epochs", "--retrain-epochs", "--iters", "--clips", "--rounds", "--images", "--iterations",
             "--width-channels", "--test-every", "--test-batches", "--ps", "--d", "--heads", "--seq", "--regions",
             "--steps", "--ranks", "--repeats", "--eval-every", "--val-windows"}
    seen = 0
    for module in commands.MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"bppsa.commands.{module}").register(sub)
        for cmd, parser in sub.choices.items():
            for action in parser._actions:
                if set(action.option_strings) & sizes and action.type is not None:
                    seen += 1
                    assert action.type is positive_int, f"bppsa {cmd} {action.option_strings[0]}: {action.type}"
    assert seen >= 20
