"""A live optimizer's state (internal): where each param's state is across the ranks
(describers), the collective gather, the torch ``state_dict`` hooks, regions cut from tensors,
host buffers, the training job's own state, the model's other tensors.

Modules: :mod:`.placement` (``describe``: which describer an optimizer gets),
:mod:`.sharding_model` (the layout every path reads), :mod:`.describers` (the grid, whole in
one process), :mod:`.owners` (owner rules, DDP replicas), :mod:`.values` (state values
classified), :mod:`.gather` (the collective gather), :mod:`.hooks`, :mod:`.regions`,
:mod:`.paramnames`, :mod:`.hostcopy`, :mod:`.arena`, :mod:`.trainstate`, :mod:`.model_state`.
Its public names are re-exported by :mod:`muonckpt`.
"""
