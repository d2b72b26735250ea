"""The MoE models of issue 35's scale benchmark and test, by their shapes only: a Kimi-K2-shaped
model (61 layers, the first dense, 60 of 384 experts with 3 matrices each, plus attention,
norms, router, shared expert, embedding and head: 69,854 params) and a Moonlight-shaped one
(27 layers of 64 experts: 5,320 params), with Megatron-length names (~75 characters:
``model.decoder.layers.12.mlp.experts.local_experts.301.linear_fc1_gate.weight``) and a tiny
hidden size, so that the metadata is real-sized and the data small.

``plan_rank`` plans one rank's share of an N-rank load without starting N processes, through
the functions a real load calls (:func:`muonckpt.files.pieces.open_checkpoint` without
the pieces, then :func:`~muonckpt.files.pieces.load_pieces` of the params the rank holds
under :func:`muonckpt.layout.topology.arrange`, the packaged Muon's layout).
"""

from __future__ import annotations

from pathlib import Path

Shape = tuple[str, tuple[int, ...], int]
"""name, shape, tp_split_dim (-1: replicated)."""

MODELS = {"k2": (61, 384, 1), "moonlight": (27, 64, 1)}
"""model -> (layers, experts per MoE layer, dense layers first)."""


def moe_shapes(layers: int, experts: int, dense: int = 1, hidden: int = 8) -> list[Shape]:
    """Every param of the model, in model order."""
    h, prefix = hidden, "model.decoder"
    shapes: list[Shape] = [("model.embedding.word_embeddings.weight", (64 * h, h), 0)]
    for layer in range(layers):
        at = f"{prefix}.layers.{layer}"
        shapes += [
            (f"{at}.input_layernorm.weight", (h,), -1),
            (f"{at}.self_attention.linear_q_down_proj.weight", (h, h), 0),
            (f"{at}.self_attention.linear_q_up_proj.weight", (2 * h, h), 0),
            (f"{at}.self_attention.linear_kv_down_proj.weight", (h, h), 0),
            (f"{at}.self_attention.linear_kv_up_proj.weight", (2 * h, h), 0),
            (f"{at}.self_attention.linear_proj.weight", (h, 2 * h), 1),
            (f"{at}.self_attention.q_layernorm.weight", (h,), -1),
            (f"{at}.self_attention.kv_layernorm.weight", (h,), -1),
            (f"{at}.pre_mlp_layernorm.weight", (h,), -1),
        ]
        if layer < dense:
            shapes += [
                (f"{at}.mlp.linear_fc1.weight", (4 * h, h), 0),
                (f"{at}.mlp.linear_fc2.weight", (h, 4 * h), 1),
            ]
            continue
        shapes += [
            (f"{at}.mlp.router.weight", (experts, h), -1),
            (f"{at}.mlp.shared_experts.linear_fc1.weight", (2 * h, h), 0),
            (f"{at}.mlp.shared_experts.linear_fc2.weight", (h, 2 * h), 1),
        ]
        for e in range(experts):
            local = f"{at}.mlp.experts.local_experts.{e}"
            shapes += [
                (f"{local}.linear_fc1_gate.weight", (h, h), 0),
                (f"{local}.linear_fc1_up.weight", (h, h), 0),
                (f"{local}.linear_fc2.weight", (h, h), 1),
            ]
    shapes += [
        (f"{prefix}.final_layernorm.weight", (h,), -1),
        ("model.output_layer.weight", (64 * h, h), 0),
    ]
    return shapes


def model_shapes(model: str, hidden: int = 8, layers: int | None = None) -> list[Shape]:
    """The named model's shapes (``layers``: fewer layers, for a smoke run)."""
    count, experts, dense = MODELS[model]
    return moe_shapes(count if layers is None else layers, experts, dense, hidden)


def held_names(manifest, dp: int, tp: int, rank: int) -> list[str]:
    """The params whose state rank ``rank`` of a dp x tp load of the packaged Muon holds."""
    from muonckpt.layout.topology import ParamSpec, Topology, arrange

    specs = [
        ParamSpec(e.name, e.shape, tp_split_dim=e.tp_split_dim, group=e.group)
        for e in manifest.params
    ]
    layout = arrange(specs, Topology(dp, tp))
    coords = layout.topology.coords(rank)
    return [s.name for i, s in enumerate(specs) if layout.region(i, *coords).numel]


def plan_rank(path: Path, dp: int, tp: int, rank: int) -> dict[str, float]:
    """One rank's load planned: the top level read, then the piece indexes of its params, as
    :func:`muonckpt.load` reads them; the metadata bytes read and the indexes opened."""
    from muonckpt.files.pieces import indexes_for, load_pieces, open_checkpoint

    files, top = open_checkpoint(path, pieces=False)
    names = held_names(top, dp, tp, rank)
    chosen = indexes_for(top, names)
    share = load_pieces(files, top, names)
    read = (path / "manifest.json").stat().st_size + sum(i.bytes for i in chosen)
    return {
        "params": len(names),
        "indexes": len(chosen),
        "pieces": len(share.pieces),
        "bytes": read,
    }


def toy_model(model: str, layers: int | None):
    """The model as a :class:`muonckpt.demo.ToyModel` for the packaged Muon: its matrices in
    the Muon group, the rest in the AdamW group, TP split dims as :func:`split_dims`; its
    params and gradients generated from fixed seeds, alike at every dp x tp."""
    from muonckpt.demo import ToyModel
    from muonckpt.layout.topology import LayoutOptions

    shapes = model_shapes(model, layers=layers)
    return ToyModel(
        muon_params={name: shape for name, shape, _ in shapes if len(shape) == 2},
        adamw_params={name: shape for name, shape, _ in shapes if len(shape) != 2},
        tp_split_dims=split_dims(model, layers),
        layout=LayoutOptions(),
        seed=0,
    )


def build_checkpoint(model: str, layers: int | None, path: Path) -> dict[str, float]:
    """(in a child) The packaged Muon over the model's params in one process (momentum for the
    matrices, AdamW's two moments for the rest, and the values), one step, saved: its time
    and the peak RSS growth of the save alone (VmHWM reset before it)."""
    import time

    from common import reset_peak_rss, status_bytes

    import muonckpt

    toy = toy_model(model, layers)
    opt, _, _, _ = toy.build(1, 1, toy.initial_params())
    toy.train(opt, None, 0, 0, 0, 1)
    base = reset_peak_rss()
    start = time.perf_counter()
    muonckpt.save(opt, path)
    took = time.perf_counter() - start
    growth = (status_bytes("VmHWM") - base) / 1e6
    return {"save_s": took, "save_growth_mb": growth, "params": len(toy.shapes)}


def load_and_step(dp: int, tp: int, path: str, model: str, layers: int | None) -> dict:
    """(a gloo rank of a dp x tp job) The packaged Muon built over zeros, loaded from ``path``
    (timed, with the peak RSS growth of the load alone), then the second step taken: this
    rank's params, the load's seconds and MB."""
    import time

    from common import reset_peak_rss, status_bytes

    import muonckpt
    from muonckpt.demo import local_params

    toy = toy_model(model, layers)
    opt, sharded, d, t = toy.build(dp, tp, toy.zeros())
    base = reset_peak_rss()
    start = time.perf_counter()
    muonckpt.load(opt, path)
    took = time.perf_counter() - start
    growth = (status_bytes("VmHWM") - base) / 1e6
    toy.train(opt, sharded, d, t, 1, 1)
    return {"load_s": took, "load_growth_mb": growth, "params": local_params(opt)}


def resumed_bitwise(dp: int, tp: int, path: Path, model: str, layers: int | None) -> dict:
    """A real dp x tp job (gloo processes) resumed from ``path`` (saved after step 1) and
    stepped once more, against one process that took both steps uninterrupted: how many params
    differ in any bit, and the slowest rank's load time."""
    import torch

    from muonckpt.demo import local_params
    from muonckpt.distributed.launch import run_distributed

    out = run_distributed(load_and_step, dp * tp, dp, tp, str(path), model, layers, timeout=1200)
    toy = toy_model(model, layers)
    full = toy.assemble(dp, tp, [o["params"] for o in out])
    opt, _, _, _ = toy.build(1, 1, toy.initial_params())
    toy.train(opt, None, 0, 0, 0, 2)
    expected = local_params(opt)
    differ = sum(not torch.equal(full[name], value) for name, value in expected.items())
    return {
        "differ": differ,
        "params": len(expected),
        "load_s": max(o["load_s"] for o in out),
        "load_growth_mb": max(o["load_growth_mb"] for o in out),
    }


def split_dims(model: str, layers: int | None) -> dict[str, int]:
    """Each param's TP split dim, for ``reshard``'s ``tp_split_dims`` (a torch optimizer's
    checkpoint records none)."""
    return {name: dim for name, _, dim in model_shapes(model, layers=layers) if dim >= 0}


def metadata_bytes(path: Path) -> dict[str, float]:
    """What a checkpoint's metadata takes: its top level, its piece indexes, and both."""
    top = (path / "manifest.json").stat().st_size
    indexes = [p.stat().st_size for p in path.glob("*.pieces.json")]
    return {"top_mb": top / 1e6, "index_mb": sum(indexes) / 1e6, "indexes": len(indexes)}
