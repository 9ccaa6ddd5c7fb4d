"""Analytic transposed Jacobians: recurrent ones as batched dense blocks, layer ones as CSR."""
