"""Every foreign reader refuses a field of an unexpected type in one line naming the file and
the field, never a traceback (issue 50, finding 6's 16 field-type variants), and names the
real cause of what finding 8 and 9 found misnamed or accepted: each built from the trainers'
own files (tests/fixtures), one field rewritten, converted through the command line."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app
from muonckpt.interop.deepspeed import files as deepspeed_files

from .hostile_files import (
    ACCELERATE,
    DEEPSPEED,
    LIGHTNING,
    MCORE,
    MCORE_TORCH,
    TITAN,
    copy,
    megatron_root,
    nested,
    refused,
    resave,
    rewrite_dcp,
)

META = torch.empty(24, 8, device="meta")
SPARSE = torch.zeros(24, 8).to_sparse()


def _deepspeed(tmp: Path, rank: int, change: Callable[[Any], None]) -> tuple[Path, Path]:
    """The DeepSpeed fixture with rank ``rank``'s optimizer state dict changed."""
    src = copy(DEEPSPEED, tmp / "src")
    file = src / "global_step3" / deepspeed_files.rank_file(rank)
    resave(file, lambda top: change(top["optimizer_state_dict"]))
    return src, file


def _adam(optim: dict[str, Any]) -> dict[str, Any]:
    """The aux Adam group's state in a DeepSpeed rank's optimizer state dict."""
    return optim["base_optimizer_state"]["state"][1]


def _each_rank(change: Callable[[Any], None]) -> Callable[[Path], tuple[Path, Path]]:
    def build(tmp: Path) -> tuple[Path, Path]:
        src, file = _deepspeed(tmp, 0, change)
        resave(
            src / "global_step3" / deepspeed_files.rank_file(1),
            lambda t: change(t["optimizer_state_dict"]),
        )
        return src, file

    return build


def _set_step(value: Any) -> Callable[[Any], None]:
    return lambda optim: _adam(optim).__setitem__("step", value)


def _deepspeed_cases() -> dict[str, Callable[[Path], tuple[Path, Path]]]:
    return {
        "deepspeed meta partition": lambda t: _deepspeed(
            t, 0, lambda o: o["single_partition_of_fp32_groups"].__setitem__(
                0, torch.empty(o["single_partition_of_fp32_groups"][0].numel(), device="meta"))
        ),
        "deepspeed sparse exp_avg": lambda t: _deepspeed(
            t, 0, lambda o: _adam(o).__setitem__("exp_avg", _adam(o)["exp_avg"].to_sparse())
        ),
        "deepspeed nan step": _each_rank(_set_step(math.nan)),
        "deepspeed inf step": _each_rank(_set_step(math.inf)),
        "deepspeed bool step": _each_rank(_set_step(True)),
        "deepspeed str step": _each_rank(_set_step("3")),
        "deepspeed short paddings": lambda t: _deepspeed(
            t, 0, lambda o: o.__setitem__("param_alignment_paddings", [[0]])
        ),
        "deepspeed deep setting": _each_rank(
            lambda o: o["base_optimizer_state"]["param_groups"][1].__setitem__("betas", nested(40))
        ),
    }  # fmt: skip


def _megatron(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], tuple[Path, Path]]:
    def build(tmp: Path) -> tuple[Path, Path]:
        root = megatron_root(tmp / "mcore", edit)
        # A DCP item is refused naming the file it is in: .metadata or a .distcp data file.
        return root, root / "iter_0000003"

    return build


def _muon_group(common: dict[str, Any]) -> dict[str, Any]:
    return common["optimizer"][0]["optimizer"]["param_groups"][0]


def _megatron_torch(change: Callable[[Any], None]) -> Callable[[Path], tuple[Path, Path]]:
    def build(tmp: Path) -> tuple[Path, Path]:
        root = copy(MCORE_TORCH, tmp / "mcore")
        file = root / "iter_0000003" / "mp_rank_00" / "layer_wise_optimizer_0.pt"
        resave(file, lambda ranks: change(ranks[0]["optimizer"]))
        return root, file

    return build


def _torch_file(
    src: Path, name: str, change: Callable[[Any], None], tmp: Path
) -> tuple[Path, Path]:
    root = copy(src, tmp / "src")
    file = next(root.glob(name))
    resave(file, change)
    return (root if file.suffix == ".bin" else file), file


def _accelerate(change: Callable[[Any], None]) -> Callable[[Path], tuple[Path, Path]]:
    return lambda t: _torch_file(ACCELERATE, "optimizer_1.bin", lambda o: change(o["state"][0]), t)


def _lightning(change: Callable[[Any], None]) -> Callable[[Path], tuple[Path, Path]]:
    return lambda t: _torch_file(
        LIGHTNING, "*.ckpt", lambda c: change(c["optimizer_states"][1]["state"][0]), t
    )


def _titan(fqn: str, value: Any) -> Callable[[Path], tuple[Path, Path]]:
    def build(tmp: Path) -> tuple[Path, Path]:
        dst = tmp / "titan" / "step-3"
        if isinstance(value, torch.Tensor):
            src = rewrite_dcp(TITAN, dst, data={fqn: value})
        else:
            src = rewrite_dcp(TITAN, dst, edit=lambda values: values.__setitem__(fqn, value))
        return src, src  # .metadata or the .distcp file holding the item

    return build


CASES = {
    **_deepspeed_cases(),
    "megatron nan common_step": _megatron(
        lambda c: c["optimizer"][1]["optimizer"]["state"].__setitem__("common_step", math.nan)
    ),
    "megatron str momentum": _megatron(lambda c: _muon_group(c).__setitem__("momentum", "0.9")),
    "megatron deep setting": _megatron(lambda c: _muon_group(c).__setitem__("lr", nested(40))),
    "megatron-torch meta momentum": _megatron_torch(
        lambda o: o["state"][0].__setitem__("momentum_buffer", torch.empty(8, 8, device="meta"))
    ),
    "megatron-torch sparse momentum": _megatron_torch(
        lambda o: o["state"][0].__setitem__("momentum_buffer", torch.zeros(8, 8).to_sparse())
    ),
    "accelerate meta exp_avg": _accelerate(lambda s: s.__setitem__("exp_avg", META)),
    "accelerate str step": _accelerate(lambda s: s.__setitem__("step", "abc")),
    "accelerate nan step": _accelerate(lambda s: s.__setitem__("step", torch.tensor(math.nan))),
    "lightning sparse exp_avg": _lightning(lambda s: s.__setitem__("exp_avg", SPARSE)),
    "lightning bool step": _lightning(lambda s: s.__setitem__("step", True)),
    "torchtitan nan momentum": _titan("optimizer.param_groups.layers.0.experts.momentum", math.nan),
    "torchtitan str momentum": _titan("optimizer.param_groups.layers.0.experts.momentum", "0.9"),
    "torchtitan nan step": _titan(
        "optimizer.state.layers.0.norm.weight.step", torch.tensor(math.nan)
    ),
    "torchtitan deep lr": _titan("optimizer.param_groups.layers.0.experts.lr", nested(40)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_field_of_the_wrong_type_is_one_line_naming_the_file(case, tmp_path):
    src, file = CASES[case](tmp_path)
    args = [str(src), "--to", "torch"]
    if "torchtitan" in case:
        args += ["--from", "torchtitan"]
    refused(args, tmp_path / "out", str(file))


def _ds_copy(tmp: Path) -> tuple[Path, Path, Path]:
    src = copy(DEEPSPEED, tmp / "src")
    tag = src / "global_step3"
    return src, tag / deepspeed_files.rank_file(0), tag / deepspeed_files.MODEL_STATES


def test_a_deepspeed_param_id_without_state_is_named(tmp_path):
    """Rank 0's aux Adam group lists param id 7, which its state does not hold (before: read
    as no state, then refused as a step differing on rank 1, naming rank 1's file)."""
    src, rank0, _ = _ds_copy(tmp_path)
    groups = lambda top: top["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]  # noqa: E731
    resave(rank0, lambda top: groups(top)[1].__setitem__("params", [7]))
    refused([str(src)], tmp_path / "out", str(rank0), "param id 7 has no state")


def test_deepspeed_ranks_that_did_not_all_step_are_named(tmp_path):
    """Rank 1's file holds no state at all (a save before its first step), rank 0's does:
    before, rank 1's Adam moments were silently zeros in a committed output."""
    src, _, _ = _ds_copy(tmp_path)
    rank1 = src / "global_step3" / deepspeed_files.rank_file(1)
    resave(rank1, lambda top: top["optimizer_state_dict"]["base_optimizer_state"]["state"].clear())
    refused([str(src)], tmp_path / "out", str(rank1), "the ranks did not all step")


def test_an_empty_deepspeed_param_shapes_is_named(tmp_path):
    """Before: 'shared_params does not map other names to the optimizer's params'."""
    src, _, model = _ds_copy(tmp_path)
    resave(model, lambda top: top.__setitem__("param_shapes", []))
    refused([str(src)], tmp_path / "out", str(model), "param_shapes holds no param group")
    resave(model, lambda top: top.__setitem__("param_shapes", [{}]))
    refused([str(src)], tmp_path / "out", str(model), "param_shapes[0] names no param")


def _within(seconds: float, run: Callable[[], Any]) -> None:
    """``run()`` on a thread of its own, finished within ``seconds`` (a blocking open of a
    FIFO would never return)."""
    import threading

    failure: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:  # (re-raised below)
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    if failure:
        raise failure[0]


@pytest.mark.parametrize(
    "fifo",
    [
        "latest_checkpointed_iteration.txt",
        "iter_0000003/metadata.json",
        "iter_0000003/mp_rank_00/model_optim_rng.pt",
    ],
)
def test_a_megatron_fifo_is_named_as_not_a_regular_file(fifo, tmp_path):
    """Before: a FIFO for latest_checkpointed_iteration.txt (or the torch format's
    model_optim_rng.pt) made the root no Megatron checkpoint ('give --to'), one for
    metadata.json 'no metadata.json' (listing it)."""
    root = copy(MCORE_TORCH if "mp_rank" in fifo else MCORE, tmp_path / "mcore")
    (root / fifo).unlink()
    os.mkfifo(root / fifo)
    args = [str(root), "--to", "torch"]
    _within(30, lambda: refused(args, tmp_path / "out", str(root / fifo), "not a regular file"))


def test_a_non_ascii_digit_in_megatron_s_latest_is_refused(tmp_path):
    """'²' passes str.isdigit() and fails int(): before, a ValueError traceback."""
    root = copy(MCORE, tmp_path / "mcore")
    (root / "latest_checkpointed_iteration.txt").write_text("3²")
    latest = str(root / "latest_checkpointed_iteration.txt")
    refused([str(root), "--to", "torch"], tmp_path / "out", latest, "'3²', not a number")


def test_a_megatron_step_of_true_is_refused(tmp_path):
    """Before: True became step 1, in both of Megatron's formats."""
    state = lambda c: c["optimizer"][1]["optimizer"]["state"]  # noqa: E731
    root = megatron_root(tmp_path / "dist", lambda c: state(c).__setitem__("common_step", True))
    metadata = str(root / "iter_0000003" / ".metadata")
    refused([str(root), "--to", "torch"], tmp_path / "out", metadata, "common_step True")
    root = copy(MCORE_TORCH, tmp_path / "torch")
    for rank in (0, 1):
        file = root / "iter_0000003" / "mp_rank_00" / f"layer_wise_optimizer_{rank}.pt"
        resave(file, _torch_format_step(True))
    refused([str(root), "--to", "torch"], tmp_path / "out", "step True is not a step count")


def _torch_format_step(value: Any) -> Callable[[Any], None]:
    """Every AdamW step of a torch-format layer_wise_optimizer file set to ``value``."""

    def change(chained: Any) -> None:
        for sd in chained:
            for state in sd["optimizer"]["state"].values():
                if "step" in state:
                    state["step"] = value

    return change


@pytest.mark.parametrize("kind", ["deepspeed", "megatron"])
def test_an_output_inside_a_foreign_root_is_refused(kind, tmp_path):
    """Before: checked against the tag (iteration) directory only, so ROOT/out was written."""
    root = copy(DEEPSPEED if kind == "deepspeed" else MCORE, tmp_path / "root")
    refused([str(root), "--to", "torch"], root / "out", "is inside the source checkpoint")


def test_a_setting_nests_at_most_extra_depth_levels(tmp_path):
    """At the limit (the group's settings, then 23 lists: EXTRA_DEPTH levels) the conversion
    commits a checkpoint its own reader takes; one level more is refused before anything is
    written, naming the file (before: committed, then refused by every reader)."""
    import muonckpt
    from muonckpt.format.manifest import EXTRA_DEPTH

    def betas(depth: int) -> Callable[[Any], None]:
        return lambda o: o["base_optimizer_state"]["param_groups"][1].__setitem__(
            "betas", nested(depth)
        )

    src, _ = _each_rank(betas(EXTRA_DEPTH - 1))(tmp_path / "at")
    result = CliRunner().invoke(app, ["convert", str(src), "-o", str(tmp_path / "at" / "out")])
    assert result.exit_code == 0, result.output
    assert muonckpt.verify(tmp_path / "at" / "out") == []
    src, file = _each_rank(betas(EXTRA_DEPTH))(tmp_path / "past")
    message = refused([str(src)], tmp_path / "past" / "out", str(file))
    assert f"more than {EXTRA_DEPTH} levels" in message


@pytest.mark.parametrize("kind", ["lightning", "accelerate"])
def test_an_int64_step_tensor_is_kept_an_int(kind, tmp_path):
    """AdamW's step saved as ``tensor(3)`` (int64): kept the int 3 of an I64 scalar (before:
    turned into 3.0 and refused at the read-back, 'scalar step: 3.0 is not a I64 value',
    blaming the output). The DeepSpeed reader's case: tests/test_deepspeed_layouts.py."""
    build = _lightning if kind == "lightning" else _accelerate
    src, _ = build(lambda s: s.__setitem__("step", torch.tensor(3)))(tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["convert", str(src), "-o", str(out)])
    assert result.exit_code == 0, result.output
    steps = [e.scalars["step"] for e in muonckpt.read_manifest(out).params if "step" in e.scalars]
    assert any(s.value == 3 and type(s.value) is int and s.dtype == "I64" for s in steps), steps
