"""IRMAS data: the stand-in's format, the MFCC sets of Table 3, bad clips, downloads, the CLI and the schema."""
from __future__ import annotations

import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml

from bppsa.cli import main
from bppsa.data import irmas

ROOT = Path(__file__).resolve().parents[1]
# one worker for the file: the corpus fixture is built once, and librosa's numba kernels (compiled at its first
# use in a fresh venv, ~13 s on two cores) once
pytestmark = pytest.mark.xdist_group("test_irmas")
NAME = re.compile(r"^\[(\w{3})\](\[(dru|nod)\])?\[(cou_fol|cla|pop_roc|lat_sou|jaz_blu)\]\d{4}__[123]\.wav$")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A tiny stand-in: 22 clips, two per instrument at most."""
    return irmas.make_synthetic(tmp_path_factory.mktemp("irmas") / irmas.CORPUS, clips=22, seed=7, threads=1)


def _copy(corpus: Path, dest: Path) -> Path:
    shutil.copytree(corpus, dest)
    return dest


def test_class_counts_follow_irmas_proportions():
    full = irmas._class_counts(6705)
    assert full == irmas.IRMAS_COUNTS and sum(full.values()) == 6705
    small = irmas._class_counts(220)
    assert sum(small.values()) == 220 and min(small.values()) >= 1
    assert small["voi"] > small["cel"]  # 778 vs 388 in IRMAS
    assert sum(irmas._class_counts(11).values()) == 11
    with pytest.raises(ValueError, match="synthetic_clips"):
        irmas._class_counts(10)


def test_stand_in_has_the_irmas_layout_and_format(corpus):
    files = irmas.list_corpus(corpus)
    assert len(files) == 22
    assert [p.parent.name for p, _ in files] == [irmas.CLASSES[k] for _, k in files]
    assert sorted({k for _, k in files}) == list(range(11))
    for path, k in files:
        m = NAME.match(path.name)
        assert m, path.name
        assert m.group(1) == irmas.CLASSES[k]
        info = sf.info(str(path))
        assert (info.samplerate, info.channels, info.frames, info.subtype) == (44100, 2, 132300, "PCM_16")
    assert irmas.corpus_source(corpus) == irmas.SOURCE_SYNTHETIC


def test_stand_in_is_deterministic_and_seeded(tmp_path, corpus):
    again = irmas.make_synthetic(tmp_path / "a" / irmas.CORPUS, clips=22, seed=7, threads=2)
    other = irmas.make_synthetic(tmp_path / "b" / irmas.CORPUS, clips=22, seed=8, threads=1)
    a = [p.read_bytes() for p, _ in irmas.list_corpus(corpus)]
    assert a == [p.read_bytes() for p, _ in irmas.list_corpus(again)]  # parallel == serial, same seed
    assert a != [p.read_bytes() for p, _ in irmas.list_corpus(other)]
    assert not [p for p in tmp_path.rglob(".synth-*")]  # no temporary folder left behind
    with pytest.raises(FileExistsError, match="not a synthetic stand-in"):
        (tmp_path / "real").mkdir()
        irmas.make_synthetic(tmp_path / "real", clips=22)


def test_every_instrument_has_its_own_timbre_and_sane_levels():
    assert list(irmas.TIMBRES) == list(irmas.CLASSES)
    assert len(set(irmas.TIMBRES.values())) == len(irmas.CLASSES)  # no two classes synthesised alike
    for inst in irmas.CLASSES:
        a = irmas.synth_clip(inst, np.random.default_rng(1))
        assert a.shape == (irmas.SAMPLES, 2) and np.isfinite(a).all()
        peak = np.abs(a).max()
        assert 0.3 <= peak <= 0.9, (inst, peak)  # loud enough for 16 bits, never clipped
        assert np.sqrt((a ** 2).mean()) > 0.01, inst


@pytest.mark.parametrize("name", ["s", "m", "l"])
def test_mfcc_shapes_and_normalisation(corpus, name):
    import librosa

    spec = irmas.MFCC_SETS[name]
    audio = irmas.read_clip(irmas.list_corpus(corpus)[0][0])
    X = irmas.clip_mfcc(audio, spec)
    assert X.shape == {"s": (259, 38), "m": (517, 24), "l": (1034, 12)}[name]
    assert X.dtype == np.float32
    np.testing.assert_allclose(X.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(X.std(0), 1, atol=1e-3)
    # column j of channel 1 is librosa's coefficient j + 1 of the right channel, normalised
    ref = librosa.feature.mfcc(y=audio[1], sr=44100, n_mfcc=spec.n_mfcc, n_fft=spec.n_fft, hop_length=spec.hop)[1]
    half = spec.features // 2
    np.testing.assert_allclose(X[:, half], (ref - ref.mean()) / ref.std(), atol=1e-3)


def test_write_mfcc_records_labels_and_source(corpus, tmp_path):
    out = tmp_path / "mfcc_l.npz"
    summary = irmas.write_mfcc(corpus, out, "L", threads=2)
    assert summary == {"set": "l", "clips": 22, "skipped": 0, "source": irmas.SOURCE_SYNTHETIC,
                       "shape": (22, 1034, 12)}
    d = irmas.load_mfcc(out)
    assert d["X"].shape == (22, 1034, 12) and d["X"].dtype == np.float32
    assert d["source"] == "synthetic IRMAS stand-in"
    assert d["classes"] == list(irmas.CLASSES)
    assert [d["classes"][k] for k in d["y"]] == [Path(f).parent.name for f in d["files"]]
    assert "0 skipped" in irmas.skipped_path(out).read_text()
    assert not list(tmp_path.glob(".*tmp*"))


def test_real_corpus_is_labelled_irmas(corpus, tmp_path):
    real = _copy(corpus, tmp_path / irmas.CORPUS)
    (real / irmas.MARKER).unlink()
    assert irmas.corpus_source(real) == "IRMAS"


def _break(root: Path) -> dict[str, str]:
    """Five kinds of bad clip; returns file name -> the phrase its error must contain."""
    files = [p for p, _ in irmas.list_corpus(root)]
    bad = {}
    files[0].write_bytes(b"RIFF\x00\x00junk, not audio")
    bad[files[0].name] = "unreadable"
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) // 2])  # cut mid-stream: a download that stopped
    bad[files[1].name] = "truncated"
    a, _ = sf.read(str(files[2]))
    sf.write(str(files[3]), a[:, 0], 44100, subtype="PCM_16")
    bad[files[3].name] = "channel"
    sf.write(str(files[4]), a[::2], 22050, subtype="PCM_16")
    bad[files[4].name] = "22050 Hz"
    sf.write(str(files[5]), a[: 2 * 44100], 44100, subtype="PCM_16")
    bad[files[5].name] = "samples"
    return bad


def test_bad_clips_error_naming_the_file_or_are_skipped_and_listed(corpus, tmp_path):
    root = _copy(corpus, tmp_path / irmas.CORPUS)
    bad = _break(root)
    for path, _ in irmas.list_corpus(root):
        if path.name in bad:
            with pytest.raises(irmas.BadAudioError) as ei:
                irmas.read_clip(path)
            assert path.name in str(ei.value) and bad[path.name] in str(ei.value)
    out = tmp_path / "mfcc_s.npz"
    with pytest.raises(irmas.BadAudioError, match=re.escape(next(iter(bad)))):
        irmas.write_mfcc(root, out, "s", on_bad_file="error")
    assert not out.exists()
    summary = irmas.write_mfcc(root, out, "s", threads=2, on_bad_file="skip")
    assert summary["skipped"] == len(bad) and summary["clips"] == 22 - len(bad)
    report = irmas.skipped_path(out).read_text()
    for name in bad:
        assert name in report
    d = irmas.load_mfcc(out)
    assert d["X"].shape == (22 - len(bad), 259, 38) and np.isfinite(d["X"]).all()
    assert not set(bad) & {Path(f).name for f in d["files"]}


def test_missing_instrument_folder_is_named(corpus, tmp_path):
    root = _copy(corpus, tmp_path / irmas.CORPUS)
    shutil.rmtree(root / "sax")
    with pytest.raises(FileNotFoundError, match="sax"):
        irmas.list_corpus(root)
    with pytest.raises(FileNotFoundError, match="irmas.source"):
        irmas.prepare(str(tmp_path / "nowhere"), tmp_path, clips=22)


def test_a_zip_without_the_training_folder_is_refused_and_leaves_nothing(tmp_path):
    """(Downloads against a real HTTP server with faults: tests/test_data_sources.py.)"""
    bad = tmp_path / "bad"
    bad.mkdir()
    with zipfile.ZipFile(bad / "x.zip", "w") as zf:
        zf.writestr("README.txt", "no audio here")
    with pytest.raises(RuntimeError, match="no IRMAS-TrainingData"):
        irmas._extract_zip(bad / "x.zip", bad)
    assert sorted(p.name for p in bad.iterdir()) == ["x.zip"]


def test_cli_make_irmas_and_mfcc(corpus, tmp_path, capsys):
    man = tmp_path / "corpus.json"
    argv = ["make-irmas", "--source", str(corpus), "--root", str(tmp_path), "--clips", "10", "--out", str(man)]
    assert main(argv) == 0
    out = tmp_path / "mfcc_m.npz"
    assert main(["mfcc", "--corpus", str(man), "--set", "M", "--out", str(out)]) == 0
    assert irmas.load_mfcc(out)["X"].shape == (22, 517, 24)
    root = _copy(corpus, tmp_path / "broken" / irmas.CORPUS)
    bad = _break(root)
    capsys.readouterr()
    assert main(["mfcc", "--corpus", str(root), "--set", "s", "--out", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and next(iter(bad)) in err
    assert main(["mfcc", "--corpus", str(root), "--set", "s", "--on-bad-file", "skip",
                 "--out", str(tmp_path / "x.npz")]) == 0
    assert "skipped" in capsys.readouterr().err


def test_schema_accepts_both_profiles_and_names_bad_keys():
    jsonschema = pytest.importorskip("jsonschema")
    schema = yaml.safe_load((ROOT / "workflow/schemas/gru.schema.yaml").read_text())
    for cfg in ("config/config.yaml", "config/paper.yaml"):
        conf = yaml.safe_load((ROOT / cfg).read_text())
        if "gru" not in conf:
            pytest.skip(f"{cfg} has no gru section yet")
        jsonschema.validate(conf, schema)
    conf = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    conf["gru"]["epochs"] = 3
    with pytest.raises(jsonschema.ValidationError, match="epochs"):
        jsonschema.validate(conf, schema)
    conf = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    conf["irmas"]["on_bad_file"] = "ignore"
    with pytest.raises(jsonschema.ValidationError, match="ignore"):
        jsonschema.validate(conf, schema)


def test_a_broken_mfcc_file_is_named_through_the_benchmarks_reader(tmp_path):
    from bppsa.data import DatasetError
    from bppsa.data.sequences import open_dataset

    bad = tmp_path / "mfcc_m.npz"
    np.savez(bad, X=np.zeros((2, 3, 4), np.float32), y=np.zeros(2))  # no classes or source: not an MFCC set
    with pytest.raises(DatasetError, match=r"mfcc_m.npz is not an MFCC set \(missing classes, source\)"):
        open_dataset(bad)
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(DatasetError, match="cut.npz"):
        irmas.load_mfcc(tmp_path / "cut.npz")
