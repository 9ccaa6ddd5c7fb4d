"""`bppsa make-irmas` and `bppsa mfcc`: the IRMAS data of the GRU experiment (Sec 4.2); Fig 9 and 13: `bppsa plot gru`.

Timing and training reuse the generic recurrent commands: ``bppsa bench --model gru --data
data/irmas/mfcc_s.npz ...`` and ``bppsa train --model gru ...``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .. import io
from ..data import irmas
from .argtypes import positive_int


def register(sub) -> None:
    p = sub.add_parser("make-irmas", help="the IRMAS training set: download, synthetic stand-in, or an existing folder")
    p.add_argument("--source", default="synthetic",
                   help="download | synthetic | <path to an IRMAS-TrainingData folder> (config irmas.source)")
    p.add_argument("--root", default="data/irmas", help="where downloads and the stand-in live")
    p.add_argument("--url", default=irmas.URL, help="with --source download: where from (config irmas.url; a mirror)")
    p.add_argument("--md5", default=irmas.MD5, help="with --source download: the zip's MD5 (config irmas.md5)")
    p.add_argument("--clips", type=positive_int, required=True,
                   help="stand-in size (config irmas.synthetic_clips; 6705 = the real training set's)")
    p.add_argument("--seed", type=int, default=0, help="stand-in seed")
    p.add_argument("--threads", type=int, default=1, help="worker processes for the stand-in")
    p.add_argument("--out", required=True, help="manifest JSON naming the corpus folder (the rule's output)")
    p.set_defaults(func=_make_irmas)

    p = sub.add_parser("mfcc", help="one MFCC set of Table 3 from an IRMAS training folder")
    p.add_argument("--corpus", required=True, help="manifest written by make-irmas, or an IRMAS-TrainingData folder")
    p.add_argument("--set", required=True, choices=sorted(irmas.MFCC_SETS), type=str.lower)
    p.add_argument("--threads", type=int, default=1, help="worker processes (files are processed in parallel)")
    p.add_argument("--on-bad-file", choices=irmas.ON_BAD_FILE, default="error",
                   help="error: stop at the first bad clip, naming it; skip: leave it out and list it in "
                        "<out stem>.skipped.txt")
    p.add_argument("--out", required=True, help="output .npz (X [N, frames, features] float32, y, classes, source)")
    p.set_defaults(func=_mfcc)


def corpus_root(corpus: str | Path) -> Path:
    """The training folder a manifest (or the folder itself) names."""
    corpus = Path(corpus)
    if corpus.is_dir():
        return corpus
    if not corpus.is_file():
        raise FileNotFoundError(f"IRMAS corpus {corpus} does not exist (run `bppsa make-irmas` first)")
    try:
        return Path(json.loads(corpus.read_text())["root"])
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{corpus}: not an IRMAS manifest written by `bppsa make-irmas` ({exc})") from exc


def _make_irmas(args) -> int:
    root = irmas.prepare(args.source, args.root, clips=args.clips, seed=args.seed, threads=args.threads,
                         url=args.url, md5=args.md5)
    files = irmas.list_corpus(root)
    counts = {c: 0 for c in irmas.CLASSES}
    for _, k in files:
        counts[irmas.CLASSES[k]] += 1
    manifest = {"root": str(root), "source": irmas.corpus_source(root), "config_source": args.source,
                "clips": len(files), "per_class": counts}
    if args.source == "synthetic":
        manifest.update(seed=args.seed, requested_clips=args.clips)
    io.write_json(args.out, manifest)
    print(f"{manifest['source']}: {len(files)} clips under {root}", file=sys.stderr)
    return 0


def _mfcc(args) -> int:
    t0 = time.perf_counter()
    summary = irmas.write_mfcc(corpus_root(args.corpus), args.out, args.set, threads=args.threads,
                               on_bad_file=args.on_bad_file)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["threads"] = args.threads
    print(json.dumps(summary), file=sys.stderr)
    if summary["skipped"]:
        print(f"{summary['skipped']} clip(s) skipped; see {irmas.skipped_path(args.out)}", file=sys.stderr)
    return 0
