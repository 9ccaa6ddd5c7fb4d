"""Datasets: generated (bitstreams), downloaded (IRMAS, CIFAR-10) and their offline stand-ins."""


class DatasetError(RuntimeError):
    """A dataset file that is missing, truncated or not what its reader expects; the message names the file."""
