"""BPPSA: back-propagation by parallel scan -- reproduction harness."""
__version__ = "0.1.0"
