"""Save and load (internal): the entry points and their steps, the executor that writes a plan,
reading a checkpoint's pieces, and the checkpoints under a directory.

Modules: :mod:`.api` (``save``, ``async_save``, ``load``), :mod:`.options` (``SaveOptions``),
:mod:`.saving`, :mod:`.loading`, :mod:`.writing`, :mod:`.pieces`, :mod:`.retention`; the
private helpers of these (a leading underscore): :mod:`._attempt` (a rank's outcome carried to
the next step), :mod:`._save_manifest` (a save's manifest draft), :mod:`._reports` (what the
ranks of a write report), :mod:`._directory_steps` (the step protocol of a background save),
:mod:`._reading` and :mod:`._taking` (a load's share read, then handed to the optimizers). Its
public names are re-exported by :mod:`muonckpt`.
"""
