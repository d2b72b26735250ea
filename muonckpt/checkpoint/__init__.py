"""Save and load (internal): the entry points and their steps, the executor that writes a plan,
reading a checkpoint's pieces, and the checkpoints under a directory.

Modules: :mod:`.api` (``save``, ``async_save``, ``load``), :mod:`.saving`, :mod:`.loading`,
:mod:`.writing`, :mod:`.pieces`, :mod:`.retention`. Its public names are re-exported by
:mod:`muonckpt`.
"""
