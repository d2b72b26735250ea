"""The muonckpt test suite: a package, so its helper modules import as ``tests.<name>``.

Helpers (``fixture_model``, ``resume_cases``, ``ckpt_cases``, ``kj_muon``, ``seed_port``,
``commit_race``) are imported relatively by the tests, and by module path in the gloo children
that ``muonckpt.distributed.launch.run_distributed`` starts (they unpickle their function by name).
"""
