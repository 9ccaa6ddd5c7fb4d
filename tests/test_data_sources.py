"""The paper profile's real-data path, offline: IRMAS and CIFAR-10 downloaded from a real HTTP server
on 127.0.0.1 that drops connections and answers 503 and 416, through the workflow's own rules;
untrusted bytes (pickles, archive members) refused before they can run or land anywhere."""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from archives import IRMAS_FILES, cifar_tarball, irmas_zip
from fault_server import Drop, FaultServer, Status

from bppsa.cli import main
from bppsa.data import cifar, irmas
from bppsa.data.download import DownloadError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def irmas_bytes(tmp_path_factory) -> bytes:
    return irmas_zip(tmp_path_factory.mktemp("srv") / "IRMAS-TrainingData.zip")


@pytest.fixture(scope="module")
def cifar_bytes(tmp_path_factory) -> bytes:
    return cifar_tarball(tmp_path_factory.mktemp("srv") / "cifar-10-python.tar.gz")


@pytest.fixture
def no_sleep(monkeypatch):
    monkeypatch.setattr("bppsa.data.download.time.sleep", lambda s: None)


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ------------------------------------------------------------------------------------------------
# untrusted bytes
# ------------------------------------------------------------------------------------------------
def test_the_original_batch_format_loads(cifar_bytes, tmp_path):
    with tarfile.open(fileobj=io.BytesIO(cifar_bytes)) as tar:
        tar.extractall(tmp_path, filter="data")
    xtr, ytr, xte, yte = cifar.load_cifar10_arrays(tmp_path / cifar.FOLDER)
    assert xtr.shape == (60, 3, 32, 32) and xtr.dtype == "uint8" and ytr.shape == (60,) and xte.shape[0] == 12


def test_a_batch_that_would_run_code_is_refused_naming_the_file(cifar_bytes, tmp_path, capsys):
    with tarfile.open(fileobj=io.BytesIO(cifar_bytes)) as tar:
        tar.extractall(tmp_path, filter="data")
    folder = tmp_path / cifar.FOLDER
    marker = tmp_path / "ran"
    (folder / "data_batch_2").write_bytes(pickle.dumps({b"data": _Evil(marker), b"labels": []}, protocol=2))
    with pytest.raises(cifar.UnsafePickle, match=r"data_batch_2.*refusing to load posix\.system"):
        cifar.load_cifar10_arrays(folder)
    assert not marker.exists()
    # through the workflow's command: the manifest is not written, the file is named
    out = tmp_path / "cifar10.json"
    assert main(["make-cifar10", "--source", str(folder), "--root", str(tmp_path), "--out", str(out)]) == 2
    assert "data_batch_2" in capsys.readouterr().err and not out.exists() and not marker.exists()


def test_models_checkpoint_is_loaded_as_weights_only(tmp_path, capsys):
    marker = tmp_path / "ran"
    torch.save({"width": 0.0625, "dense": {}, "pruned": {}, "payload": _Evil(marker)}, tmp_path / "models.pt")
    man = tmp_path / "cifar10.json"
    assert main(["make-cifar10", "--source", "standin", "--root", str(tmp_path), "--out", str(man)]) == 0
    rc = main(["vgg11-flops", "--models", str(tmp_path / "models.pt"), "--data", str(man), "--networks", "pruned",
               "--samples", "1", "--L-m", "2", "--dense-limit-gb", "1", "--out", str(tmp_path / "f.csv")])
    assert rc != 0 and not marker.exists() and "weights_only" in capsys.readouterr().err.replace("\n", " ")


def test_archive_members_that_point_outside_are_refused(tmp_path):
    zpath = tmp_path / "IRMAS-TrainingData.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr(f"{irmas.CORPUS}/cel/[cel][cla]0001__1.wav", b"RIFF")
        zf.writestr("../../escaped.txt", b"out")
    (tmp_path / "root").mkdir()
    with pytest.raises(RuntimeError, match=r"'\.\./\.\./escaped\.txt' would land outside"):
        irmas._extract_zip(zpath, tmp_path / "root")
    assert not list(tmp_path.rglob("escaped.txt")) and not (tmp_path / "root" / irmas.CORPUS).exists()

    tpath = tmp_path / "evil.tar.gz"
    with tarfile.open(tpath, "w:gz") as tar:
        for name in (f"{cifar.FOLDER}/data_batch_1", "../escaped.txt"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    md5 = hashlib.md5(tpath.read_bytes()).hexdigest()
    with pytest.raises(cifar.CorruptFile, match="evil.tar.gz: cannot be extracted"):
        cifar.resolve(str(tpath), tmp_path / "c", md5=md5)
    assert not list(tmp_path.rglob("escaped.txt")) and not (tmp_path / "c" / cifar.FOLDER).exists()


# ------------------------------------------------------------------------------------------------
# the library path against the server
# ------------------------------------------------------------------------------------------------
def test_irmas_download_resumes_and_unpacks_the_real_layout(irmas_bytes, tmp_path, no_sleep):
    md5 = hashlib.md5(irmas_bytes).hexdigest()
    with FaultServer({"/IRMAS-TrainingData.zip": irmas_bytes}) as srv:
        srv.faults += [Drop(0.4), Status(503)]
        root = irmas.download(tmp_path, srv.url("/IRMAS-TrainingData.zip"), md5)
        assert [s for _, _, s in srv.log] == [200, 503, 206]
        files = irmas.list_corpus(root)
        assert sorted((p.parent.name, p.name) for p, _ in files) == sorted(IRMAS_FILES)
        assert irmas.corpus_source(root) == "IRMAS" and not list(tmp_path.glob(".unpack-*"))
        # a wrong MD5 (another mirror's file) is refused and removed, and the corpus kept
        with pytest.raises(DownloadError, match="MD5"):
            irmas.download(tmp_path / "other", srv.url("/IRMAS-TrainingData.zip"), "0" * 32)
        assert not (tmp_path / "other" / irmas.CORPUS).exists()
        assert not (tmp_path / "other" / "IRMAS-TrainingData.zip.part").exists()
        # the same archive again: nothing is fetched
        n = len(srv.log)
        assert irmas.download(tmp_path, srv.url("/IRMAS-TrainingData.zip"), md5) == root and len(srv.log) == n


def test_unreachable_mirror_is_named_and_leaves_nothing_complete_looking(tmp_path, no_sleep):
    with pytest.raises(DownloadError, match=r"127\.0\.0\.1:9/IRMAS-TrainingData\.zip failed after 9 attempts"):
        irmas.download(tmp_path, url="http://127.0.0.1:9/IRMAS-TrainingData.zip")
    assert not (tmp_path / irmas.CORPUS).exists() and not (tmp_path / "IRMAS-TrainingData.zip").exists()


def test_make_cifar10_downloads_through_faults_and_the_manifest_loads(cifar_bytes, tmp_path, no_sleep):
    md5 = hashlib.md5(cifar_bytes).hexdigest()
    with FaultServer({"/c.tar.gz": cifar_bytes}) as srv:
        srv.faults += [Drop(0.4), Status(503)]
        out = tmp_path / "cifar10.json"
        argv = ["make-cifar10", "--source", "download", "--root", str(tmp_path / "c"), "--url", srv.url("/c.tar.gz"),
                "--md5", md5, "--out", str(out)]
        assert main(argv) == 0
        assert [s for _, _, s in srv.log] == [200, 503, 206]
    d = cifar.from_manifest(out)
    assert d.name == "CIFAR-10" and d.x_train.shape == (60, 3, 32, 32) and d.x_test.shape == (12, 3, 32, 32)
    assert (tmp_path / "c" / "cifar-10-batches-py.md5").read_text().strip() == md5


# ------------------------------------------------------------------------------------------------
# through the workflow's own rules
# ------------------------------------------------------------------------------------------------
def _snakemake(tmp_path, configs: list[Path], *targets) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", *map(str, configs),
                        "--directory", str(tmp_path), *targets],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def _mirror(tmp_path, section: str, url: str, md5: str, **extra) -> Path:
    path = tmp_path / "mirror.yaml"
    path.write_text(yaml.safe_dump({section: {"source": "download", "url": url, "md5": md5, **extra}}))
    return path


@pytest.mark.slow
@pytest.mark.dag
def test_workflow_irmas_mirror_survives_a_drop_and_a_503_then_a_416(irmas_bytes, tmp_path):
    """`snakemake data/irmas/mfcc_s.npz --configfile mirror.yaml` in one run each time: a server that
    drops the connection at 40 % and then answers 503 once; a complete .part left behind (416)."""
    md5 = hashlib.md5(irmas_bytes).hexdigest()
    # a URL with shell metacharacters reaches the command quoted, not interpreted
    path = "/IRMAS-TrainingData.zip"
    url_q = "/mirror;touch%20pwned/IRMAS-TrainingData.zip"
    with FaultServer({path: irmas_bytes, url_q.split("?")[0]: irmas_bytes}) as srv:
        srv.faults += [Drop(0.4), Status(503)]
        one = tmp_path / "one"
        one.mkdir()
        _snakemake(one, [ROOT / "config" / "config.yaml", _mirror(one, "irmas", srv.url(path) + "?download=1&x=$(id)",
                                                                 md5)], "data/irmas/mfcc_s.npz")
        assert [s for _, _, s in srv.log] == [200, 503, 206]
        mf = irmas.load_mfcc(one / "data" / "irmas" / "mfcc_s.npz")
        assert mf["X"].shape[0] == len(IRMAS_FILES) and mf["source"] == "IRMAS"
        assert "HTTP 503" in (one / "logs" / "irmas_make.log").read_text()

        two = tmp_path / "two"
        (two / "data" / "irmas").mkdir(parents=True)
        (two / "data" / "irmas" / "IRMAS-TrainingData.zip.part").write_bytes(irmas_bytes)
        srv.log.clear()
        _snakemake(two, [ROOT / "config" / "config.yaml", _mirror(two, "irmas", srv.url(url_q), md5)],
                   "data/irmas/mfcc_s.npz")
        assert srv.log == [(url_q, f"bytes={len(irmas_bytes)}-", 416)]
        assert not list(tmp_path.rglob("pwned")) and not (ROOT / "pwned").exists()
        assert (two / "data" / "irmas" / "mfcc_s.npz").is_file()


@pytest.mark.slow
@pytest.mark.dag
def test_workflow_cifar10_mirror_through_vgg11_training(cifar_bytes, tmp_path, monkeypatch):
    """The CIFAR-10 equivalent: cifar10_make (a localrule) downloads through a drop and a 503, then
    VGG-11 trains at the .test size from the manifest; a complete .part left behind ends in a 416."""
    md5 = hashlib.md5(cifar_bytes).hexdigest()
    conf = ROOT / ".test" / "config" / "config.yaml"
    with FaultServer({"/cifar-10-python.tar.gz": cifar_bytes}) as srv:
        srv.faults += [Drop(0.4), Status(503)]
        one = tmp_path / "one"
        one.mkdir()
        mirror = _mirror(one, "cifar10", srv.url("/cifar-10-python.tar.gz"), md5, root="data/cifar10")
        _snakemake(one, [conf, mirror], "results/cpu/vgg11/accuracy.csv")
        assert [s for _, _, s in srv.log] == [200, 503, 206]
        acc = (one / "results" / "cpu" / "vgg11" / "accuracy.csv").read_text()
        assert "CIFAR-10" in acc or "stand-in" not in acc

        two = tmp_path / "two"
        (two / "data" / "cifar10").mkdir(parents=True)
        (two / "data" / "cifar10" / "cifar-10-python.tar.gz.part").write_bytes(cifar_bytes)
        srv.log.clear()
        mirror = _mirror(two, "cifar10", srv.url("/cifar-10-python.tar.gz"), md5, root="data/cifar10")
        _snakemake(two, [conf, mirror], "data/cifar10/cifar10.json")
        assert srv.log == [("/cifar-10-python.tar.gz", f"bytes={len(cifar_bytes)}-", 416)]
        monkeypatch.chdir(two)  # the manifest names the folder relative to the workflow's directory
        assert cifar.from_manifest("data/cifar10/cifar10.json").x_train.shape == (60, 3, 32, 32)


def test_mirror_keys_default_to_the_canonical_sources_and_are_checked():
    from snakemake.utils import validate

    for section, schema, mod in (("irmas", "gru", irmas), ("cifar10", "vgg11", cifar)):
        path = ROOT / "workflow" / "schemas" / f"{schema}.schema.yaml"
        props = yaml.safe_load(path.read_text())["properties"][section]["properties"]
        assert (props["url"]["default"], props["md5"]["default"]) == (mod.URL, mod.MD5)
        for profile in ("config.yaml", "paper.yaml"):
            conf = yaml.safe_load((ROOT / "config" / profile).read_text())
            assert (conf[section]["url"], conf[section]["md5"]) == (mod.URL, mod.MD5)
        conf = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
        del conf[section]["url"], conf[section]["md5"]
        validate(conf, str(path))  # fills in the defaults
        assert conf[section]["url"] == mod.URL
        conf[section]["md5"] = "not-an-md5"
        with pytest.raises(Exception, match="not-an-md5"):
            validate(conf, str(path))
