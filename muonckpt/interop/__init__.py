"""Foreign checkpoint formats in and out of muonckpt's own: one module each.

A change to how another trainer's files are read or written goes here. Modules: :mod:`.dcp`
(PyTorch DCP: FSDP2 / DTensor jobs, torchtitan).
"""
