"""``python -m muonckpt.cli``, as torchrun runs the command line (``-m muonckpt.cli``)."""

from muonckpt.cli import main

main()
