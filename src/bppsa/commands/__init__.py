"""Sub-commands of the `bppsa` CLI; each module exposes ``register(subparsers)``."""
