"""Analytic transposed Jacobians: recurrent ones as batched dense blocks, layer ones as CSR."""

# the RNN's Jacobian layouts (recurrent.py), here without torch: the workflow reads them when it parses
LAYOUTS = ("paper", "fused")
