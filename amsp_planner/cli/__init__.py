"""The `amsp` command line: one module per command, heavy imports deferred into the bodies."""
