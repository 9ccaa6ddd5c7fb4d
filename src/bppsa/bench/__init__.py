"""Timing protocol and the training/benchmark loops that write the CSVs."""
