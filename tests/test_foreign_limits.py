"""Hostile foreign files are bounded (issue 50, findings 3, 4 and 8): every foreign reader
(pickle, DCP, JSON) runs under the limits of ``muonckpt.storage.foreign_limits``.

A "billion laughs" param group (a few KB: pickle's memo makes shared references tiny) through
the Lightning, DeepSpeed, accelerate and both Megatron readers; a stride-0 tensor in a
Lightning ``.ckpt`` (7.7 KB -> 1 GiB of output before); a compressed ``torch.save`` archive
that inflates past its bound; a truncated one; a blocked global in a DCP value (its message
cut, with raw ANSI codes, before it named the global). Each limit is tested at the limit
(accepted) and one past it (refused), on real ``torch.save`` files.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from muonckpt import CheckpointError, MuonCkptError, interop
from muonckpt.interop import _trainer_files as hf_files
from muonckpt.interop.deepspeed import files as deepspeed_files
from muonckpt.interop.megatron import files as megatron_files
from muonckpt.storage import foreign_limits as limits

from .conftest import REPO
from .hostile_files import PEAK_RSS

FIXTURES = Path(__file__).parent / "fixtures"
(LIGHTNING,) = (FIXTURES / "lightning" / "named" / "checkpoints").glob("*.ckpt")
DEEPSPEED = FIXTURES / "deepspeed" / "w2_z1_torchadam_fp32" / "ckpt"
DS_RANK0 = Path("global_step3") / deepspeed_files.rank_file(0)
MEGATRON = FIXTURES / "megatron"
MEGATRON_ITER = Path("checkpoint") / "iter_0000003"
ALLOWANCE = 256 << 20
"""The extra memory a few-KB hostile file may cost (docs/reliability.md)."""
SECONDS = 10.0
"""The CPU time it may cost, torch's import aside."""


def _laughs(levels: int = 9) -> list[Any]:
    """10**levels strings in a few hundred bytes of pickle: each level ten references to one
    list."""
    value: list[Any] = ["lol"]
    for _ in range(levels):
        value = [value] * 10
    return value


def _lightning(tmp_path: Path, change) -> Path:
    top = torch.load(LIGHTNING, weights_only=True)
    change(top)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / LIGHTNING.name
    torch.save(top, path)
    return path


def _lightning_group(top: dict, key: str, value: Any) -> None:
    top["optimizer_states"][0]["param_groups"][0][key] = value


def _deepspeed_resave(path: Path, change) -> None:
    """Rewrite a DeepSpeed rank file with ``change`` made, its stand-ins pickled under
    DeepSpeed's own names again (as DeepSpeed writes them)."""
    value = deepspeed_files.load(path)
    change(value)
    buffer, out = io.BytesIO(), io.BytesIO()
    torch.save(value, buffer)
    names = {
        f"c{cls.__module__}\n{cls.__qualname__}\n".encode(): f"c{name.rsplit('.', 1)[0]}\n"
        f"{name.rsplit('.', 1)[1]}\n".encode()
        for name, cls in deepspeed_files.STAND_INS.items()
    }
    with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                for ours, theirs in names.items():
                    data = data.replace(ours, theirs)
            dst.writestr(info.filename, data)
    path.write_bytes(out.getvalue())


def _deepspeed(tmp_path: Path, change) -> Path:
    src = Path(shutil.copytree(DEEPSPEED, tmp_path / "ds"))
    _deepspeed_resave(src / DS_RANK0, change)
    return src


def _ds_group(top: dict, key: str, value: Any) -> None:
    top["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0][key] = value


_MEASURE = (
    PEAK_RSS
    + """
import json, sys, time
import muonckpt.cli, muonckpt.offline, torch
runs = []
for argv in json.loads(sys.argv[1]):
    before = peak_rss()
    cpu = time.process_time()
    sys.argv = ["muonckpt", *argv]
    try:
        muonckpt.cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    after = peak_rss()
    runs.append({"code": code, "extra": after - before, "cpu": time.process_time() - cpu})
print(json.dumps(runs))
"""
)


def _measured(runs: list[list[str]]) -> tuple[list[str], list[dict[str, Any]]]:
    """``muonckpt RUN`` for each of ``runs`` in one child under :data:`_MEASURE`, which must
    end cleanly with no traceback: the ``error:`` lines and each run's exit code, extra memory
    and CPU."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(runs)],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    return errors, json.loads(done.stdout)


@pytest.mark.dist
def test_few_kb_hostile_files_through_the_cli_are_refused_in_bounded_memory_and_time(tmp_path):
    """A billion laughs in a param group of a Lightning ``.ckpt`` and of a DeepSpeed rank file,
    and a Lightning ``.ckpt`` holding torch.empty(1).expand(2**28): each one ``error:`` line
    naming the file and the limit, under 256 MiB of extra memory and 10 s of CPU (before: the
    laughs ran until killed, past 2.7 GB; the expansion wrote a 1 GiB output)."""
    laughs = _lightning(tmp_path / "laughs", lambda t: _lightning_group(t, "laughs", _laughs()))
    tmp = tmp_path / "expanded"
    expanded = _lightning(tmp, lambda t: t["state_dict"].update(x=torch.empty(1).expand(2**28)))
    ds = _deepspeed(tmp_path, lambda t: _ds_group(t, "laughs", _laughs()))
    victims = (laughs, expanded, ds / DS_RANK0)
    assert all(path.stat().st_size < 64 << 10 for path in victims)
    runs = [
        ["convert", str(laughs), "--from", "lightning", "-o", str(tmp_path / "a")],
        ["convert", str(expanded), "--from", "lightning", "-o", str(tmp_path / "b")],
        ["convert", str(ds), "-o", str(tmp_path / "c")],
    ]
    errors, measured = _measured(runs)
    assert len(errors) == 3, errors
    said = (f"more than {limits.MAX_ELEMENTS} values", "strides [0]", "more than 4194304 values")
    for error, words, victim in zip(errors, said, victims, strict=True):
        assert words in error and str(victim) in error, error
    for run in measured:
        assert run["code"] == 2 and run["extra"] < ALLOWANCE and run["cpu"] < SECONDS, run
    assert not any((tmp_path / name).exists() for name in "abc")


def _pickle_bomb(path: Path, size: int, opcode: bytes) -> None:
    """Rewrite the ``torch.save`` file ``path`` with its ``data.pkl`` replaced by a deflated
    pickle of exactly ``size`` bytes, ``{'x': [...]}`` whose list is one empty container per
    byte (``opcode``): what unpickling builds the most objects from (finding F1's file)."""
    head, tail = b"\x80\x02}q\x00X\x01\x00\x00\x00x](", b"es."
    pickled = head + opcode * (size - len(head) - len(tail)) + tail
    with zipfile.ZipFile(path) as src:
        members = [(info.filename, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w") as dst:
        for name, data in members:
            if name.endswith("/data.pkl"):
                dst.writestr(name, pickled, compress_type=zipfile.ZIP_DEFLATED)
            else:
                dst.writestr(name, data)


@pytest.mark.dist
def test_a_compressed_pickle_bomb_through_the_cli_is_bounded_at_the_limit_and_one_past(tmp_path):
    """Finding F1: a Lightning ``.ckpt`` of 32 KB whose deflated ``data.pkl`` is 16 MiB of
    empty dicts peaked at 1.56 GB and 15 s before its refusal (the same through DeepSpeed's
    model states). A compressed pickle of ``MAX_INFLATED_PICKLE`` bytes of empty sets (216
    bytes each, the most one byte builds) is unpickled and walked within 256 MiB and 10 s;
    one byte more, and the 16 MiB ones, are refused before inflating, naming the file."""
    limit = limits.MAX_INFLATED_PICKLE
    ds = Path(shutil.copytree(DEEPSPEED, tmp_path / "ds"))
    victims = [ds / "global_step3" / deepspeed_files.MODEL_STATES]
    _pickle_bomb(victims[0], 16 << 20, b"}")
    runs = [["convert", str(ds), "-o", str(tmp_path / "ds_out")]]
    # refused first: each run's peak is measured above the peaks of the runs before it
    cases = [("f1", 16 << 20, b"}"), ("past", limit + 1, b"\x8f"), ("at", limit, b"\x8f")]
    for name, size, opcode in cases:
        victims.append(tmp_path / name / LIGHTNING.name)
        victims[-1].parent.mkdir()
        shutil.copyfile(LIGHTNING, victims[-1])
        _pickle_bomb(victims[-1], size, opcode)
        out = str(tmp_path / f"{name}_out")
        runs.append(["convert", str(victims[-1]), "--from", "lightning", "-o", out])
    assert all(path.stat().st_size < 64 << 10 for path in victims)
    errors, measured = _measured(runs)
    assert len(errors) == 4, errors
    for error, victim, size in zip(errors[:3], victims, [16 << 20, 16 << 20, limit + 1]):
        said = f"declares {size} bytes uncompressed, more than {limit}"
        assert said in error and "refused before inflating" in error, error
        assert str(victim) in error, error
    assert "holds no 'state_dict'" in errors[3] and str(victims[3]) in errors[3], errors[3]
    for run in measured:
        assert run["code"] == 2 and run["extra"] < ALLOWANCE and run["cpu"] < SECONDS, run
    assert not any(path.name.endswith("_out") for path in tmp_path.iterdir())


def _refused_by(call, *words: str) -> str:
    with pytest.raises(MuonCkptError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and "\x1b" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


def test_billion_laughs_in_the_other_readers_are_refused(tmp_path):
    """accelerate's ``optimizer.bin``, a Megatron torch-format optimizer file and a Megatron
    torch_dist common state (a DCP value): a billion laughs in a param group, refused naming
    the file (before: each ran until killed)."""
    src = Path(shutil.copytree(FIXTURES / "accelerate" / "named" / "state", tmp_path / "acc"))
    victim = src / "optimizer.bin"
    state = torch.load(victim, weights_only=True)
    state["param_groups"][0]["laughs"] = _laughs()
    torch.save(state, victim)
    run = lambda: interop.from_accelerate(src, tmp_path / "acc_out")  # noqa: E731
    _refused_by(run, f"more than {limits.MAX_ELEMENTS} values", str(victim))

    root = Path(shutil.copytree(MEGATRON / "tp1_dp2_torch" / "checkpoint", tmp_path / "mt"))
    victim = root / "iter_0000003" / "mp_rank_00" / "layer_wise_optimizer_1.pt"
    chained = megatron_files.load(victim)
    chained[0]["optimizer"]["param_groups"][0]["laughs"] = _laughs()
    torch.save(chained, victim)
    run = lambda: interop.from_megatron(root, tmp_path / "mt_out")  # noqa: E731
    _refused_by(run, f"more than {limits.MAX_ELEMENTS} values", str(victim))

    def laugh(common: Any) -> Any:
        common[0]["optimizer"][0]["optimizer"]["param_groups"][0]["laughs"] = _laughs()
        return common

    root = _megatron_dist_common(tmp_path / "md", laugh)
    run = lambda: interop.from_megatron(root, tmp_path / "md_out")  # noqa: E731
    _refused_by(run, "common_state", f"more than {limits.MAX_ELEMENTS} values", "__0_0.distcp")


def _megatron_dist_common(tmp_path: Path, change) -> Path:
    """A copy of a Megatron torch_dist checkpoint whose common state is ``change``'s (its
    ``args`` left out: their stand-in is not for saving), appended to a data file as DCP
    stores a value."""
    from muonckpt.interop.dcp import files as dcp_files
    from muonckpt.interop.dcp import metadata as dcp_metadata
    from muonckpt.interop.megatron import reader as megatron

    root = Path(shutil.copytree(MEGATRON / "tp1_dp2" / "checkpoint", tmp_path))
    directory = root / "iter_0000003"
    index = dcp_metadata.read_index(directory)
    fqn = next(f for f in index.values if f.startswith("common_state"))
    common = dcp_files.read_value(index, index.values[fqn], megatron.ADMITTED)
    del common[0]["args"]
    buffer = io.BytesIO()
    torch.save(change(common), buffer)
    data = directory / index.values[fqn].file
    start = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buffer.getvalue())
    metadata = pickle.loads((directory / ".metadata").read_bytes())  # the test's own copy
    (key,) = [k for k in metadata.storage_data if k.fqn == fqn]
    info = metadata.storage_data[key]
    info.offset, info.length = start, len(buffer.getvalue())
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    return root


def _loaded(tmp_path: Path, value: Any) -> Any:
    """``value`` through a real ``torch.save`` file and the restricted loader."""
    path = tmp_path / "value.pt"
    torch.save({"x": value}, path)
    return hf_files.load(path)


def _over(tmp_path: Path, value: Any, *words: str) -> None:
    path = tmp_path / "value.pt"
    _refused_by(lambda: _loaded(tmp_path, value), *words, str(path))


def test_depth_at_the_limit_and_one_past(tmp_path):
    """The file's top dict and 31 lists inside it are 32 levels: read; 33 are refused."""
    value: Any = []
    for _ in range(limits.MAX_DEPTH - 2):
        value = [value]
    assert _loaded(tmp_path, value)["x"] == value
    _over(tmp_path, [value], f"nests more than {limits.MAX_DEPTH} levels deep", "at ['x'][0]")
    shared = [[value]] * 3  # reached again through a shared reference: still refused
    _over(tmp_path, [1, shared], f"nests more than {limits.MAX_DEPTH} levels")


def test_items_at_the_limit_and_one_past(tmp_path):
    """Walked as loaded (a file of a million items takes torch's unpickler seconds to read)."""
    limits.check_value([None] * limits.MAX_ITEMS, tmp_path)
    with pytest.raises(CheckpointError, match=f"holds 1048577 items, more than {limits.MAX_ITEMS}"):
        limits.check_value({"x": [None] * (limits.MAX_ITEMS + 1)}, tmp_path)


def _elements(total: int) -> dict[str, Any]:
    """A file's content of exactly ``total`` values as expanded: its top dict, 2 keys, a list
    of 2047 references to one list of 2047 numbers, and a padding list of numbers."""
    inner = [0] * 2047
    return {"x": [inner] * 2047, "y": [0] * (total - 5 - 2047 * 2048)}


def test_total_values_at_the_limit_and_one_past(tmp_path):
    path = tmp_path / "value.pt"
    torch.save(_elements(limits.MAX_ELEMENTS), path)
    hf_files.load(path)
    torch.save(_elements(limits.MAX_ELEMENTS + 1), path)
    _refused_by(lambda: hf_files.load(path), f"more than {limits.MAX_ELEMENTS} values")


def test_total_text_at_the_limit_and_one_past(tmp_path):
    """1023 references to one 64 KiB string and a padding string: 2**26 characters with the
    keys, each reference counted where it is used."""
    path = tmp_path / "value.pt"
    text = "x" * (1 << 16)
    for extra in (0, 1):
        padding = "y" * (limits.MAX_TEXT - 2 - 1023 * len(text) + extra)
        torch.save({"x": [text] * 1023, "y": padding}, path)
        if extra:
            _refused_by(lambda: hf_files.load(path), f"more than {limits.MAX_TEXT} characters")
        else:
            hf_files.load(path)


def test_tensor_reuse_at_the_limit_and_one_past(tmp_path):
    """A tensor used 16 times over its storage's bytes is read (tied weights use theirs twice);
    17 are refused."""
    t = torch.zeros(16)
    assert len(_loaded(tmp_path, [t] * limits.MAX_TENSOR_REUSE)["x"]) == limits.MAX_TENSOR_REUSE
    _over(tmp_path, [t] * (limits.MAX_TENSOR_REUSE + 1), "more than 16 times over")


def test_views_that_expand_or_overlap_are_refused_others_read(tmp_path):
    """Transposed, sliced with gaps, offset and zero-element views are read as torch.save
    keeps them; a stride-0 expansion and an overlapping view are refused."""
    base = torch.arange(24.0).reshape(4, 6)
    views = [base.t(), base[:, ::2], base[1:, 2:], base[:0], base[0:1, 3:4]]
    got = _loaded(tmp_path, views)["x"]
    assert all(torch.equal(a, b) for a, b in zip(got, views, strict=True))
    _over(tmp_path, [torch.zeros(3).expand(4, 3)], "strides [0, 1]", "stride-0")
    overlapping = torch.zeros(4).as_strided((3, 2), (1, 1))
    _over(tmp_path, overlapping, "strides [1, 1]", "overlapping view")


def _compressed(path: Path, inflated: int) -> None:
    """A torch.save archive re-zipped with deflate, its members declaring ``inflated`` bytes
    in all (a byte tensor of zeros sized to make it so)."""
    members: dict[str, bytes] = {}
    for _ in range(2):  # the pickle's length depends a little on the size it names
        others = sum(len(data) for name, data in members.items() if not name.endswith("/0"))
        buffer = io.BytesIO()
        torch.save(torch.zeros(inflated - others, dtype=torch.uint8), buffer)
        with zipfile.ZipFile(buffer) as archive:
            members = {info.filename: archive.read(info) for info in archive.infolist()}
    assert sum(len(data) for data in members.values()) == inflated
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def test_compressed_archive_at_the_limit_and_one_past(tmp_path):
    """A few-KB archive whose compressed members declare 64 MiB is read; one byte more is
    refused before anything is inflated (before: a 1 MB one peaked at 1.26 GB)."""
    path = tmp_path / "zipped.pt"
    _compressed(path, limits.MAX_INFLATED_BYTES)
    assert path.stat().st_size < 1 << 20
    assert hf_files.load(path).numel() > 0
    _compressed(path, limits.MAX_INFLATED_BYTES + 1)
    _refused_by(lambda: hf_files.load(path), f"more than {limits.MAX_INFLATED_BYTES} bytes")


def test_a_stored_member_declaring_more_than_it_stores_is_refused(tmp_path):
    path = tmp_path / "lying.pt"
    torch.save(torch.zeros(4), path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        (name,) = [i.filename.encode() for i in archive.infolist() if i.filename.endswith("/0")]
    at = data.index(b"PK\x01\x02")  # the central directory's entries
    while data[at + 46 : at + 46 + struct.unpack_from("<H", data, at + 28)[0]] != name:
        at = data.index(b"PK\x01\x02", at + 4)
    at += 24  # the entry's uncompressed size
    struct.pack_into("<I", data, at, 1 << 30)
    path.write_bytes(bytes(data))
    _refused_by(lambda: hf_files.load(path), "declares 1073741824 bytes but stores 16", str(path))


def test_a_truncated_file_is_named_truncated(tmp_path):
    """Before: ``cannot read: Invalid argument``."""
    data = LIGHTNING.read_bytes()
    path = tmp_path / LIGHTNING.name
    for size in (len(data) // 2, len(data) - 1):
        path.write_bytes(data[:size])
        run = lambda: interop.from_lightning(path, tmp_path / "out")  # noqa: E731
        _refused_by(run, "truncated", f"({size} bytes", str(path))


def test_a_blocked_global_is_named_in_one_line(tmp_path):
    """A global torch does not allow, in a Lightning file and in a DCP value (Megatron's
    common state): one line naming it, no terminal codes (before, the DCP value's refusal was
    cut before it named the global, with raw ANSI codes)."""
    path = _lightning(tmp_path, lambda t: t["state_dict"].update(x=Fraction(1, 3)))
    run = lambda: interop.from_lightning(path, tmp_path / "out")  # noqa: E731
    _refused_by(run, "GLOBAL fractions.Fraction is not allowed", str(path))
    root = _megatron_dist_common(tmp_path / "md", lambda common: [Fraction(1, 3), common])
    run = lambda: interop.from_megatron(root, tmp_path / "md_out")  # noqa: E731
    _refused_by(run, "common_state", "GLOBAL fractions.Fraction is not allowed", ".distcp")


def test_an_opcode_torch_does_not_read_is_named_in_the_one_line(tmp_path):
    """Minor finding M1: a Lightning step of 10**5000 (pickled as ``LONG4``, which torch's
    restricted unpickler does not read): the line names torch's cause (before, it ended at
    torch's "WeightsUnpickler error:", the cause cut)."""
    path = _lightning(tmp_path, lambda t: t.update(global_step=10**5000))
    run = lambda: interop.from_lightning(path, tmp_path / "out")  # noqa: E731
    _refused_by(run, "UnpicklingError: Unsupported operand 139", str(path))


def test_a_names_file_nested_past_the_parser_is_refused(tmp_path):
    names = tmp_path / "names.json"
    names.write_text("[" * 100_000 + "]" * 100_000)
    src = FIXTURES / "accelerate" / "plain" / "state"
    run = lambda: interop.from_accelerate(src, tmp_path / "out", names=names)  # noqa: E731
    _refused_by(run, "nested more than 32 levels", str(names))
    names.write_text(json.dumps([[[[[]]]]]))
    for _ in range(limits.MAX_DEPTH - 4):
        names.write_text(f"[{names.read_text()}]")
    _refused_by(run, f"nests more than {limits.MAX_DEPTH} levels", str(names))


def test_check_value_counts_a_shared_container_where_it_is_used():
    """Unit: a billion laughs is measured without expanding it, and a cycle is refused."""
    with pytest.raises(CheckpointError, match="more than 4194304 values"):
        limits.check_value(_laughs(12), Path("f"))
    looped: list[Any] = [1]
    looped.append(looped)
    with pytest.raises(CheckpointError, match="holds itself"):
        limits.check_value(looped, Path("f"))
    limits.check_value({"a": [1, 2], "b": (3.0, "x"), "c": {1, 2}}, Path("f"))


def _crafted(path: Path, pickled: bytes) -> None:
    """A torch.save archive whose pickle is ``pickled`` (what a hostile file's would be)."""
    buffer, out = io.BytesIO(), io.BytesIO()
    torch.save({}, buffer)
    with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = pickled if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    path.write_bytes(out.getvalue())


@pytest.mark.parametrize(
    "pickled,words",
    [
        (b"\x80\x02cbuiltins\nbytearray\nJ\x00\xca\x9a\x3b\x85R.", "names builtins.bytearray"),
        (b"\x80\x02ctorch\nTensor\nJ\x00\xca\x9a\x3b\x85\x81.", "bytes stored: made, not read"),
    ],
    ids=["bytearray", "tensor"],
)
def test_allocations_a_few_bytes_ask_for_are_refused(tmp_path, pickled, words):
    """An 800-byte file whose pickle calls bytearray(10**9) (torch's unpickler admits it: 1 GB
    allocated before) or torch.Tensor(10**9) (4 GB of tensor from no stored byte)."""
    path = tmp_path / "crafted.pt"
    _crafted(path, pickled)
    assert path.stat().st_size < 1024
    _refused_by(lambda: hf_files.load(path), words, str(path))
