"""BPPSA: back-propagation by parallel scan -- reproduction harness."""
from . import process as _process

_process.openmp_policy()  # before anything imports torch (bppsa.process says why)

__version__ = "0.1.0"
