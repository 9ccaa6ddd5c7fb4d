"""IRMAS (Bosch et al. 2012) for the GRU benchmark of Sec 4.2: download, offline stand-in, MFCC sets.

The training set is ``IRMAS-TrainingData/<inst>/<name>.wav``: 6,705 excerpts of 3 s, 44.1 kHz,
16-bit stereo, one folder per predominant instrument; names look like ``[cel][cla]0001__1.wav``
(instrument, then drum/genre tags, song id, excerpt number), sometimes with a ``NNN__`` prefix.
The label is the folder.  The offline stand-in has the same layout and format, a marker file in
its root, and every output made from it carries ``source = "synthetic IRMAS stand-in"``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..io import atomic_path, write_text
from . import DatasetError

CLASSES = ("cel", "cla", "flu", "gac", "gel", "org", "pia", "sax", "tru", "vio", "voi")
# Excerpts per instrument in the real training set (IRMAS documentation); 6,705 in all.  The
# stand-in keeps these proportions so class balance matches at any size.
IRMAS_COUNTS = dict(zip(CLASSES, (388, 505, 451, 637, 760, 682, 721, 626, 577, 580, 778)))
GENRES = ("cou_fol", "cla", "pop_roc", "lat_sou", "jaz_blu")
SR = 44100
SAMPLES = 3 * SR
CHANNELS = 2

URL = "https://zenodo.org/records/1290750/files/IRMAS-TrainingData.zip?download=1"
MD5 = "4fd9f5ed5a18d8e2687e6360b5f60afe"
CORPUS = "IRMAS-TrainingData"
SOURCE_REAL = "IRMAS"
SOURCE_SYNTHETIC = "synthetic IRMAS stand-in"
MARKER = "SYNTHETIC_STAND_IN.txt"
ON_BAD_FILE = ("error", "skip")


@dataclass(frozen=True)
class MfccSet:
    """One row of Table 3; ``frames``/``features`` are what a 3 s clip must give."""

    n_mfcc: int
    n_fft: int
    hop: int
    frames: int
    features: int


MFCC_SETS = {
    "s": MfccSet(n_mfcc=20, n_fft=4096, hop=512, frames=259, features=38),
    "m": MfccSet(n_mfcc=13, n_fft=2048, hop=256, frames=517, features=24),
    "l": MfccSet(n_mfcc=7, n_fft=1024, hop=128, frames=1034, features=12),
}


class BadAudioError(ValueError):
    """A clip that is not a readable 3 s, 44.1 kHz stereo WAV; the message names the file."""


def mfcc_set(name: str) -> MfccSet:
    key = str(name).lower()
    if key not in MFCC_SETS:
        raise ValueError(f"unknown MFCC set '{name}' (choose from {', '.join(MFCC_SETS)})")
    return MFCC_SETS[key]


# ------------------------------------------------------------------------------------------------
# the corpus on disk
# ------------------------------------------------------------------------------------------------
def corpus_source(root: str | Path) -> str:
    return SOURCE_SYNTHETIC if (Path(root) / MARKER).exists() else SOURCE_REAL


def list_corpus(root: str | Path) -> list[tuple[Path, int]]:
    """(file, class index) of every clip under an ``IRMAS-TrainingData`` folder, in a stable order."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"IRMAS training folder {root} does not exist")
    missing = [c for c in CLASSES if not (root / c).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"{root} is not an IRMAS training folder: instrument folder(s) {', '.join(missing)} missing")
    out = []
    for k, c in enumerate(CLASSES):
        files = sorted(p for p in (root / c).iterdir() if p.suffix.lower() == ".wav")
        if not files:
            raise FileNotFoundError(f"{root / c} holds no .wav files")
        out += [(p, k) for p in files]
    return out


def _inside(folder: Path, member: str) -> bool:
    """Whether a zip member's name stays under ``folder`` (no absolute path, drive or ``..`` out)."""
    name = member.replace("\\", "/")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return False
    base = folder.resolve()
    return (base / name).resolve().is_relative_to(base)


def _extract_zip(zip_path: Path, root: Path) -> Path:
    """Unpack into a temporary folder beside the target and rename, so a half-unpacked corpus
    never sits under the final name."""
    final = root / CORPUS
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
    try:
        try:
            with zipfile.ZipFile(zip_path) as zf:
                for name in zf.namelist():
                    if not _inside(tmp, name):
                        raise RuntimeError(f"{zip_path}: member '{name}' would land outside the folder it is "
                                           "unpacked into; refusing the archive")
                zf.extractall(tmp)
        except (zipfile.BadZipFile, OSError) as exc:
            raise RuntimeError(f"unpacking {zip_path} failed: {exc}") from exc
        found = [p for p in tmp.rglob(CORPUS) if p.is_dir()]
        if not found:
            raise RuntimeError(f"{zip_path} holds no {CORPUS}/ folder")
        list_corpus(found[0])  # refuse to publish an incomplete tree
        if final.exists():  # unpacked from another archive (see download)
            shutil.rmtree(final)
        os.replace(found[0], final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def download(root: str | Path, url: str = URL, md5: str = MD5) -> Path:
    """The real IRMAS training set under ``root/IRMAS-TrainingData`` (fetched, verified, unpacked)."""
    from .download import fetch

    root = Path(root)
    final = root / CORPUS
    unpacked_from = root / f"{CORPUS}.md5"  # the MD5 of the archive the folder came from
    if final.is_dir() and unpacked_from.is_file() and unpacked_from.read_text().strip() == md5:
        list_corpus(final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    zip_path = fetch(url, root / "IRMAS-TrainingData.zip", md5)
    _extract_zip(zip_path, root)
    unpacked_from.write_text(md5 + "\n")
    return final


def prepare(source: str, root: str | Path, clips: int, seed: int = 0, threads: int = 1,
            url: str = URL, md5: str = MD5) -> Path:
    """Resolve ``irmas.source`` (download | synthetic | <path>) to a training folder, making it if needed."""
    root = Path(root)
    if source == "download":
        return download(root, url, md5)
    if source == "synthetic":
        return make_synthetic(root / "synthetic" / CORPUS, clips=clips, seed=seed, threads=threads)
    path = Path(source)
    if not path.is_dir():
        raise FileNotFoundError(
            f"irmas.source: '{source}' is neither 'download', 'synthetic' nor an existing IRMAS-TrainingData folder")
    list_corpus(path)
    return path


# ------------------------------------------------------------------------------------------------
# the offline stand-in
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timbre:
    """What tells the classes apart: pitch range, spectrum, envelope, vibrato, noise, distortion."""

    midi: tuple[int, int]  # pitch range (MIDI note numbers)
    slope: float  # harmonic amplitudes ~ k^-slope
    odd: float = 1.0  # weight of even harmonics (clarinet-like: small)
    octaves_only: bool = False  # organ-like: harmonics 1, 2, 4, 8, ...
    formants: tuple[float, ...] = ()  # Hz; harmonics near them are boosted
    attack: float = 0.02  # s
    decay: float = 0.0  # 1/s exponential decay per note (0: sustained)
    notes: tuple[int, int] = (1, 3)  # notes per clip
    vibrato: tuple[float, float] = (0.0, 0.0)  # rate Hz, depth in semitones
    noise: float = 0.0  # breath/bow noise relative to the tone
    drive: float = 0.0  # tanh distortion gain (0: clean)
    inharm: float = 0.0  # stiff-string inharmonicity B: f_k = k f0 sqrt(1 + B k^2)
    chord: int = 1  # simultaneous notes


TIMBRES = {
    "cel": Timbre(midi=(36, 60), slope=1.0, attack=0.12, vibrato=(5.0, 0.15), noise=0.03),
    "cla": Timbre(midi=(50, 80), slope=1.1, odd=0.08, attack=0.05, noise=0.01),
    "flu": Timbre(midi=(60, 93), slope=2.5, attack=0.08, vibrato=(4.5, 0.12), noise=0.12),
    "gac": Timbre(midi=(40, 72), slope=1.3, attack=0.003, decay=3.0, notes=(3, 8), inharm=1e-4),
    "gel": Timbre(midi=(40, 76), slope=0.9, attack=0.01, decay=0.6, drive=4.0, notes=(2, 5)),
    "org": Timbre(midi=(36, 84), slope=0.3, octaves_only=True, attack=0.03, chord=3),
    "pia": Timbre(midi=(33, 96), slope=1.6, attack=0.002, decay=1.8, notes=(2, 6), inharm=4e-4, chord=2),
    "sax": Timbre(midi=(49, 80), slope=0.8, formants=(600.0, 1700.0), attack=0.04, vibrato=(5.5, 0.2), noise=0.04),
    "tru": Timbre(midi=(52, 84), slope=0.5, formants=(1200.0, 2500.0), attack=0.03, vibrato=(5.0, 0.05)),
    "vio": Timbre(midi=(55, 96), slope=1.0, attack=0.08, vibrato=(6.0, 0.3), noise=0.02),
    "voi": Timbre(midi=(45, 77), slope=1.4, formants=(700.0, 1200.0, 2600.0), attack=0.06, vibrato=(5.2, 0.35),
                  noise=0.02, notes=(1, 4)),
}


def synth_clip(inst: str, rng: np.random.Generator) -> np.ndarray:
    """One 3 s stereo clip ``[SAMPLES, 2]`` in [-1, 1]: a few notes of additive synthesis."""
    tb = TIMBRES[inst]
    t = np.arange(SAMPLES) / SR
    n_notes = int(rng.integers(tb.notes[0], tb.notes[1] + 1))
    bounds = np.sort(rng.uniform(0, SAMPLES, n_notes - 1)).astype(int)
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [SAMPLES]])
    tone = np.zeros(SAMPLES)
    for s, e in zip(starts, ends):
        if e - s < SR // 50:
            continue
        tn = t[: e - s]
        base = rng.uniform(*tb.midi)
        for v in range(tb.chord):
            midi = base + (0 if v == 0 else rng.choice([3, 4, 5, 7, 12]) * v)
            f0 = 440.0 * 2 ** ((midi - 69) / 12)
            rate, depth = tb.vibrato
            # vibrato as a pitch modulation; the phase is the integral of the frequency
            semis = depth * np.sin(2 * np.pi * rate * tn + rng.uniform(0, 2 * np.pi)) if depth else np.zeros_like(tn)
            phase = 2 * np.pi * np.cumsum(f0 * 2 ** (semis / 12)) / SR
            ks = 2 ** np.arange(7) if tb.octaves_only else np.arange(1, 25)
            fk = ks * f0 * np.sqrt(1 + tb.inharm * ks**2)
            keep = fk < 0.45 * SR
            ks, fk = ks[keep], fk[keep]
            amp = ks.astype(float) ** -tb.slope
            amp[ks % 2 == 0] *= tb.odd
            for F in tb.formants:
                amp *= 1 + 4 * np.exp(-0.5 * ((fk - F) / (0.15 * F)) ** 2)
            amp *= rng.uniform(0.8, 1.2, len(ks))  # per-clip spectral jitter
            ratio = (fk / f0)[:, None]
            note = (amp[:, None] * np.sin(ratio * phase[None, :] + rng.uniform(0, 2 * np.pi, (len(ks), 1)))).sum(0)
            tone[s:e] += note / (1 + v)
        env = np.minimum(1.0, tn / tb.attack) * np.exp(-tb.decay * tn)
        release = np.minimum(1.0, (tn[-1] - tn) / 0.01 + 1e-3)  # no clicks at note changes
        tone[s:e] *= env * release
    tone /= np.abs(tone).max() + 1e-9
    if tb.drive:
        tone = np.tanh(tb.drive * tone) / np.tanh(tb.drive)
    if tb.noise:
        noise = rng.standard_normal(SAMPLES)
        noise = np.convolve(noise, np.ones(8) / 8, mode="same")  # soft, band-limited breath
        tone += tb.noise * noise * np.abs(tone).mean() / (np.abs(noise).mean() + 1e-9) * 3
    tone += 1e-3 * rng.standard_normal(SAMPLES)  # the room: nothing is ever digital silence
    pan = rng.uniform(0.25, 0.75)
    stereo = np.stack([tone * np.sqrt(1 - pan), tone * np.sqrt(pan)], 1)
    stereo *= rng.uniform(0.3, 0.9) / (np.abs(stereo).max() + 1e-9)
    return stereo


def _class_counts(clips: int) -> dict[str, int]:
    """``clips`` split over the instruments in IRMAS proportions (largest remainder), >= 1 each."""
    if clips < len(CLASSES):
        raise ValueError(f"irmas.synthetic_clips must be at least {len(CLASSES)} (one per instrument), got {clips}")
    total = sum(IRMAS_COUNTS.values())
    exact = {c: clips * n / total for c, n in IRMAS_COUNTS.items()}
    counts = {c: max(1, int(v)) for c, v in exact.items()}
    for c in sorted(CLASSES, key=lambda c: exact[c] - int(exact[c]), reverse=True):
        if sum(counts.values()) >= clips:
            break
        counts[c] += 1
    while sum(counts.values()) > clips:  # the >= 1 floor can overshoot for tiny corpora
        c = max(counts, key=counts.get)
        counts[c] -= 1
    return counts


def _synth_job(args) -> None:
    import soundfile as sf

    path, inst, seed, k, i = args
    rng = np.random.default_rng([seed, k, i])
    sf.write(path, synth_clip(inst, rng), SR, subtype="PCM_16")


def make_synthetic(dest: str | Path, clips: int, seed: int = 0, threads: int = 1) -> Path:
    """Write the stand-in corpus to ``dest`` (an ``IRMAS-TrainingData`` folder); deterministic in ``seed``.

    An existing stand-in of the same size and seed is reused; it is built in a temporary folder and
    renamed, so an interrupted run leaves nothing that looks complete.
    """
    dest = Path(dest)
    stamp = f"{SOURCE_SYNTHETIC}: clips={clips} seed={seed}\n"
    if dest.is_dir() and (dest / MARKER).exists():
        if (dest / MARKER).read_text() == stamp:
            return dest
        shutil.rmtree(dest)  # a stand-in of another size or seed: ours to replace
    elif dest.exists():
        raise FileExistsError(f"{dest} exists and is not a synthetic stand-in; refusing to overwrite it")
    counts = _class_counts(clips)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".synth-", dir=dest.parent))
    try:
        jobs = []
        for k, inst in enumerate(CLASSES):
            (tmp / inst).mkdir()
            gen = np.random.default_rng([seed, k, 1 << 20])
            for i in range(counts[inst]):
                song, excerpt = i // 3 + 1, i % 3 + 1  # IRMAS cuts up to a few excerpts per song
                if excerpt == 1:  # genre and drums are properties of the song
                    genre = GENRES[int(gen.integers(len(GENRES)))]
                    drums = "[dru]" if gen.random() < 0.5 else "[nod]"
                name = f"[{inst}]{drums}[{genre}]{song:04d}__{excerpt}.wav"
                jobs.append((str(tmp / inst / name), inst, seed, k, i))
        _run_parallel(_synth_job, jobs, threads, desc="synthesising IRMAS stand-in", unit="clip")
        (tmp / MARKER).write_text(stamp)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# ------------------------------------------------------------------------------------------------
# MFCC sets (Table 3)
# ------------------------------------------------------------------------------------------------
def read_clip(path: str | Path) -> np.ndarray:
    """``[2, SAMPLES]`` float32 audio, or BadAudioError naming the file and what is wrong."""
    import soundfile as sf

    try:
        audio, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001 - libsndfile raises several types for broken files
        raise BadAudioError(f"{path}: unreadable audio ({exc})") from exc
    if sr != SR:
        raise BadAudioError(f"{path}: sampled at {sr} Hz, IRMAS clips are {SR} Hz")
    if audio.shape[1] != CHANNELS:
        raise BadAudioError(f"{path}: {audio.shape[1]} channel(s), IRMAS clips are stereo")
    if audio.shape[0] != SAMPLES:
        raise BadAudioError(f"{path}: {audio.shape[0]} samples ({audio.shape[0] / SR:.3f} s), IRMAS clips are "
                            f"{SAMPLES} (3 s); truncated or wrongly cut")
    if not np.isfinite(audio).all():
        raise BadAudioError(f"{path}: non-finite samples")
    return np.ascontiguousarray(audio.T)


def clip_mfcc(audio: np.ndarray, spec: MfccSet) -> np.ndarray:
    """``[frames, features]`` float32: per channel MFCC without coefficient 0, each coefficient
    normalised across the frames, channels stacked along the features."""
    import librosa

    # One call per channel: a stereo call would clip both channels' log-mel at 80 dB below the
    # louder channel's peak, coupling the channels.
    m = np.stack([librosa.feature.mfcc(y=ch, sr=SR, n_mfcc=spec.n_mfcc, n_fft=spec.n_fft, hop_length=spec.hop,
                                       center=True) for ch in audio])
    m = m[:, 1:, :].astype(np.float64)  # [2, n_mfcc - 1, frames]; c0 is only the average power
    mean = m.mean(-1, keepdims=True)
    std = m.std(-1, keepdims=True)
    # A constant coefficient has nothing to normalise; dividing by ~0 would blow it up to noise.
    m = (m - mean) / np.where(std > 1e-8, std, 1.0)
    out = m.reshape(-1, m.shape[-1]).T.astype(np.float32)
    if out.shape != (spec.frames, spec.features):
        raise AssertionError(f"MFCC shape {out.shape}, Table 3 says {(spec.frames, spec.features)}")
    return out


def _mfcc_job(args):
    path, spec = args
    try:
        return clip_mfcc(read_clip(path), spec), None
    except BadAudioError as exc:
        return None, str(exc)


def _init_worker() -> None:
    # one BLAS thread per worker process: the parallelism is over files, not inside them
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except ImportError:  # only an efficiency concern
        pass


def _run_parallel(fn, jobs, threads: int, desc: str, unit: str):
    from tqdm import tqdm

    threads = max(1, int(threads))
    if threads == 1 or len(jobs) < 2:
        return [fn(j) for j in tqdm(jobs, desc=desc, unit=unit)]
    chunk = max(1, min(32, len(jobs) // (threads * 8)))
    with ProcessPoolExecutor(max_workers=threads, initializer=_init_worker) as ex:
        return list(tqdm(ex.map(fn, jobs, chunksize=chunk), total=len(jobs), desc=desc, unit=unit))


def extract_mfcc(root: str | Path, set_name: str, threads: int = 1, on_bad_file: str = "error"):
    """MFCCs of every clip under ``root``: ``(X [N, frames, features], y [N], files, skipped)``.

    ``skipped`` lists ``"<file>: <reason>"`` for clips left out under ``on_bad_file='skip'``; under
    ``'error'`` the first bad clip raises BadAudioError naming it.
    """
    if on_bad_file not in ON_BAD_FILE:
        raise ValueError(f"irmas.on_bad_file must be one of {', '.join(ON_BAD_FILE)}, got '{on_bad_file}'")
    spec = mfcc_set(set_name)
    items = list_corpus(root)
    results = _run_parallel(_mfcc_job, [(str(p), spec) for p, _ in items], threads,
                            desc=f"MFCC set {set_name.upper()}", unit="clip")
    X, y, files, skipped = [], [], [], []
    for (path, label), (feat, err) in zip(items, results):
        if err is not None:
            if on_bad_file == "error":
                raise BadAudioError(f"{err} (set irmas.on_bad_file: skip to leave bad clips out)")
            skipped.append(err)
            continue
        X.append(feat)
        y.append(label)
        files.append(str(path.relative_to(root)))
    if not X:
        raise BadAudioError(f"no usable clip under {root}")
    return np.stack(X), np.asarray(y, dtype=np.int64), files, skipped


def skipped_path(npz: str | Path) -> Path:
    """The report of skipped clips beside an MFCC file: ``mfcc_s.npz`` -> ``mfcc_s.skipped.txt``."""
    npz = Path(npz)
    return npz.with_name(npz.stem + ".skipped.txt")


def write_mfcc(root: str | Path, out: str | Path, set_name: str, threads: int = 1, on_bad_file: str = "error") -> dict:
    """Extract one MFCC set and write it (and its skipped-clip report) atomically; return a summary."""
    root = Path(root)
    spec = mfcc_set(set_name)
    X, y, files, skipped = extract_mfcc(root, set_name, threads, on_bad_file)
    source = corpus_source(root)
    with atomic_path(out) as tmp:
        np.savez(tmp, X=X, y=y, classes=np.array(CLASSES), files=np.array(files), source=np.array(source),
                 set=np.array(set_name.lower()), n_mfcc=spec.n_mfcc, n_fft=spec.n_fft, hop_length=spec.hop, sr=SR)
    report = [f"# clips skipped while extracting MFCC set {set_name.upper()} from {root} ({source})",
              f"# {len(skipped)} skipped, {len(files)} kept"] + skipped
    write_text(skipped_path(out), "\n".join(report) + "\n")
    return {"set": set_name.lower(), "clips": len(files), "skipped": len(skipped), "source": source,
            "shape": tuple(X.shape)}


def load_mfcc(path: str | Path) -> dict:
    """An MFCC set as written by :func:`write_mfcc`: X, y, classes, source, set.  The GRU benchmarks
    read their data through this (via :func:`bppsa.data.sequences.open_dataset`)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such MFCC file (run the make_mfcc rule, `bppsa mfcc`)")
    try:
        with np.load(path, allow_pickle=False) as z:
            need = {"X", "y", "classes", "source"}
            if not need <= set(z.files):
                raise DatasetError(f"{path} is not an MFCC set (missing {', '.join(sorted(need - set(z.files)))})")
            d = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path}: truncated or corrupt MFCC file ({exc})") from exc
    X = d["X"]
    if X.ndim != 3 or X.dtype != np.float32 or len(d["y"]) != len(X):
        raise DatasetError(f"{path}: X must be float32 [N, frames, features] with one label per row")
    d["source"] = str(d["source"])
    d["classes"] = [str(c) for c in d["classes"]]
    if "set" in d:
        d["set"] = str(d["set"])
    return d
