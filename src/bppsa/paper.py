"""The numbers the paper prints (Wang, Bai & Pekhimenko, MLSys 2020), with where and on what they were measured.

Reference values only: nothing here is measured.  ``bppsa.analysis.claims`` sets them beside what this harness
measured.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperValue:
    value: float
    device: str
    where: str


GPUS = ("RTX 2070", "RTX 2080Ti")
BOTH_GPUS = " / ".join(GPUS)  # Fig 8 and 9 were measured on both
PAPER_CPU = "Ryzen Threadripper 1950X"
TABLE1_TRIALS = 1000

# Sec 5.1 / Abstract: the RNN on bitstreams
RNN_MAX_BACKWARD = PaperValue(108.0, "RTX 2080Ti", "Sec 5.1, Fig 8")
RNN_MAX_OVERALL = PaperValue(2.75, "RTX 2070", "Sec 5.1")
# Fig 7: T = 1000, B = 16, 80 epochs
RNN_FIG7_SEQ_LEN, RNN_FIG7_BATCH = 1000, 16
RNN_FIG7_OVERALL = PaperValue(2.73, "RTX 2070", "Sec 5.1, Fig 7 (T=1000, B=16)")
RNN_FIG7_BACKWARD = PaperValue(16.0, "RTX 2070", "Sec 5.1, Fig 7 (T=1000, B=16)")
# Sec 5.2: the GRU on IRMAS; the backward excludes the Jacobian-generation overhead
GRU_MAX_OVERALL = PaperValue(2.36, BOTH_GPUS, "Sec 5.2, Fig 9")
GRU_MAX_BACKWARD = PaperValue(13.4, BOTH_GPUS, "Sec 5.2, Fig 9 (excluding the overhead)")
# Fig 6 / 7 / 13: training curves
CURVES_DEVICE = "RTX 2070"

# Table 1 (VGG-11's first conv, ReLU and max-pool on 32x32), 1000 trials on a CPU
TABLE1_SPARSITY = {"Convolution": 0.99157, "ReLU": 0.99998, "Max-pooling": 0.99994}
TABLE1_SPEEDUP = {"Convolution": 8.3e3, "ReLU": 1.2e6, "Max-pooling": 1.5e5}

# Sec 4.3: VGG-11 on CIFAR-10, top-1
VGG11_DENSE_TOP1 = PaperValue(0.901, "RTX 2070 (training)", "Sec 4.3")
VGG11_PRUNED_TOP1 = PaperValue(0.889, "RTX 2070 (training)", "Sec 4.3 (97 % pruned, retrained)")
VGG11_TOP1_BY_STAGE = {"trained": VGG11_DENSE_TOP1.value, "retrained": VGG11_PRUNED_TOP1.value}

# PAPER.md, Appendix G (V100), seconds per epoch: the only GPU times the paper reports.
PAPER_EPOCH_S = {
    ("rnn", "baseline"): (53.33, "Table 4, T = 1000, B = 16, baseline"),
    ("rnn", "bppsa"): (29.29, "Table 4, T = 1000, B = 16, BPPSA"),
    ("rnn", "forward@256"): (2.13, "Table 5, 1/B = 1/256, forward only"),
    ("gru-s", "baseline"): (3.71, "Table 6, set S, B = 16, baseline"),
    ("gru-s", "bppsa"): (2.94, "Table 6, set S, B = 16, BPPSA"),
    ("gru-m", "baseline"): (6.19, "Table 6, set M, B = 16, baseline"),
    ("gru-m", "bppsa"): (4.2, "Table 6, set M, B = 16, BPPSA"),
    ("gru-l", "baseline"): (11.43, "Table 6, set L, B = 16, baseline"),
    ("gru-l", "bppsa"): (6.91, "Table 6, set L, B = 16, BPPSA"),
    ("gru-s", "forward@64"): (0.52, "Table 6, set S, B = 64, FP"),
    ("gru-m", "forward@64"): (0.86, "Table 6, set M, B = 64, FP"),
    ("gru-l", "forward@64"): (1.64, "Table 6, set L, B = 64, FP"),
}
PAPER_SAMPLES = {"rnn": 32000, "gru": 6705}  # PAPER.md: 32,000 bitstreams; 6,705 IRMAS clips
