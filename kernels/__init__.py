"""Data-movement kernels and their pure-torch references."""
