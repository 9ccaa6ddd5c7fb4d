"""Datasets: generated (bitstreams), downloaded (IRMAS, CIFAR-10) and their offline stand-ins."""
