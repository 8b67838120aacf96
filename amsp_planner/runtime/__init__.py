"""The bundled torch runtime: executes a plan under torchrun and counts what it sends.

Importing this package does not import torch; its modules do (install the `runtime` extra).
"""
