"""Save and load of a live optimizer (internal): the entry points and their steps. What they
write and read goes through :mod:`muonckpt.files` (the write engine, reading pieces, the
checkpoints under a directory).

Modules: :mod:`.api` (``save``, ``async_save``, ``load``), :mod:`.newest` (``latest``),
:mod:`.options` (``SaveOptions``), :mod:`.saving`, :mod:`.loading`; the private helpers of
these (a leading underscore):
:mod:`._save_manifest` (a save's manifest draft), :mod:`._reading` and :mod:`._taking` (a load's
share read, then handed to the optimizers). Its public names are re-exported by
:mod:`muonckpt`.
"""
