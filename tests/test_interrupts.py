"""The real CLI, interrupted by real signals: no process outlives it, its staging is removed,
or after the commit it says the output is complete.

Each test runs ``python -m muonckpt.cli reshard SRC --dp 2 --tp 1 -o OUT`` (or ``demo``, whose
ranks are processes of :func:`muonckpt.distributed.launch.run_distributed`) in a subprocess
whose environment carries a tag that every process it starts inherits (the forkserver, the
resource tracker, the ranks), so the processes it left can be found in /proc after it is gone,
whoever their parent is by then. A ``sitecustomize`` module on PYTHONPATH holds the first
``os.pwrite`` of each process (or the first deletion of a replaced checkpoint's file, after
the commit): the process says so on a FIFO the test reads, and stays there, so the signal
always comes in the middle of the writing (or of the cleanup), and the command must end a
held rank itself. Afterwards: every tagged process ends, then no OUT, nothing staged beside
it.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .dispositions import default_stop_signals

pytestmark = pytest.mark.dist

SITECUSTOMIZE = """
import os

_events = os.environ.get("MUONCKPT_TEST_EVENTS")
_held = set()


def _hold(what):
    # (once per process and what) Say what this process is doing on the test's events FIFO,
    # then wait there until the test's signal ends it (or the command kills it, a worker): in
    # turns of 0.1 s, between which Python runs a signal's handler; 120 s at most.
    if what in _held:
        return
    _held.add(what)
    import threading

    with open(_events, "w") as events:
        events.write(f"{what} {os.environ.get('RANK', 'main')} {os.getpid()}\\n")
    never = threading.Event()
    for _ in range(1200):
        never.wait(0.1)


if os.environ.get("MUONCKPT_TEST_HOLD_PWRITE"):
    _pwrite = os.pwrite

    def pwrite(fd, data, offset):
        _hold("writing")
        return _pwrite(fd, data, offset)

    os.pwrite = pwrite

if os.environ.get("MUONCKPT_TEST_HOLD_UNLINK"):
    _unlink = os.unlink

    def unlink(path, *args, **kwargs):
        name = os.fsdecode(path)
        if name.endswith(".safetensors") or name.endswith("manifest.json"):
            _hold("cleaning")
        return _unlink(path, *args, **kwargs)

    os.unlink = unlink
"""


class Channel:
    """A FIFO on which a held process of the command writes a line: what it does, its rank (or
    ``main``) and its pid."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.env = {"MUONCKPT_TEST_EVENTS": str(path)}
        # read and write: no process ever blocks opening it, nor does the test see it closed
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._buffer = b""

    def next(self, proc: subprocess.Popen, timeout: float = 90.0) -> list[str]:
        """The next line, split; an AssertionError if ``proc`` ends or stays silent first."""
        ended = os.pidfd_open(proc.pid)  # readable once the command has ended
        try:
            while b"\n" not in self._buffer:
                ready, _, _ = select.select([self._fd, ended], [], [], timeout)
                if self._fd in ready:
                    self._buffer += os.read(self._fd, 4096)
                elif ready:
                    raise AssertionError(f"the command ended first: {_signal(proc, 0)}")
                else:
                    _signal(proc, signal.SIGKILL)
                    raise AssertionError(f"no process of the command said anything in {timeout} s")
        finally:
            os.close(ended)
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().split()

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def channel(tmp_path) -> Iterator[Channel]:
    opened = Channel(tmp_path / "events")
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, single_ckpt) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("interrupts")
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"src": single_ckpt(2), "site": site}


def _tagged(tag: str) -> dict[int, str]:
    """pid -> command line of every process whose environment carries ``tag``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if f"MUONCKPT_TEST_TAG={tag}".encode() in environ:
            found[int(entry)] = cmdline.decode(errors="replace")
    return found


def _parent_pid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _start(
    setup,
    out: Path,
    tag: str,
    channel: Channel,
    *args: str,
    force: bool = False,
    **env: str,
) -> subprocess.Popen:
    """The CLI with ``args`` (default: ``reshard`` of the source to ``out``)."""
    path = os.pathsep.join([str(setup["site"]), os.environ.get("PYTHONPATH", "")])
    if not args:
        args = ("reshard", str(setup["src"]), "--dp", "2", "--tp", "1", "-o", str(out))
    command = [sys.executable, "-m", "muonckpt.cli", *args, *(["--force"] if force else [])]
    return subprocess.Popen(
        command,
        env={**os.environ, **channel.env, "MUONCKPT_TEST_TAG": tag, "PYTHONPATH": path, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_stop_signals,  # the signals these tests send, as on a terminal
    )


def _wait_until_writing(proc: subprocess.Popen, channel: Channel, ranks: set[str]) -> None:
    """Until the processes of ``ranks`` (``"0"``, ``"1"``, ``"main"``) are each held in a
    write."""
    held: set[str] = set()
    while held != ranks:
        what, rank, _ = channel.next(proc)
        assert what == "writing", (what, rank)
        held.add(rank)


def _wait_until_gone(tag: str, timeout: float = 60.0) -> None:
    """Until no tagged process is left: each wait ends when one of them exits."""
    while left := _tagged(tag):
        exits = []
        for pid in left:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                exits.append(os.pidfd_open(pid))
        try:
            ready, _, _ = select.select(exits, [], [], timeout)
        finally:
            for fd in exits:
                os.close(fd)
        assert ready or not exits, f"tagged processes still running after {timeout} s: {left}"


def _assert_nothing_left(tag: str, out: Path) -> None:
    """Every tagged process ends; then no OUT, nothing named .OUT.* beside it."""
    _wait_until_gone(tag)
    assert not out.exists()
    assert list(out.parent.glob(f".{out.name}.*")) == []


def _ranks(tag: str) -> list[int]:
    """The rank processes: tagged children of the tagged forkserver."""
    procs = _tagged(tag)
    servers = {pid for pid, cmd in procs.items() if "forkserver" in cmd}
    return sorted(pid for pid in procs if _parent_pid(pid) in servers)


def _signal(proc: subprocess.Popen, signum: int) -> str:
    """Send ``signum`` (0: none) and wait for the command to end; its stderr (killed if it
    hangs)."""
    try:
        if signum:
            proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return stderr


SLOW = pytest.mark.slow
"""SIGINT and SIGTERM reach one handler (``cli.exits._stop``, the exit code 128 + its number):
each test runs one of them in the default tier, the other in the slow tier, and the default
tier runs both."""


@pytest.mark.parametrize(
    ("signum", "code"),
    [
        pytest.param(signal.SIGKILL, -signal.SIGKILL, id="SIGKILL"),
        pytest.param(signal.SIGTERM, 143, id="SIGTERM"),
        pytest.param(signal.SIGINT, 130, id="SIGINT", marks=SLOW),
    ],
)
def test_a_signal_to_the_cli_leaves_no_process(setup, tmp_path, channel, signum, code):
    """``demo``'s two ranks, held in their writes: the command ends them, however it ends."""
    out, tag = tmp_path / "out", uuid.uuid4().hex
    demo = ("demo", "--dp", "2", "--tp", "1", "--dir", str(out))
    proc = _start(setup, out, tag, channel, *demo, MUONCKPT_TEST_HOLD_PWRITE="1")
    try:
        _wait_until_writing(proc, channel, {"0", "1"})
        assert len(_ranks(tag)) == 2
    except BaseException:
        _signal(proc, signal.SIGKILL)
        raise
    stderr = _signal(proc, signum)  # the ranks stay held: the command must end them
    assert proc.returncode == code, stderr
    if signum != signal.SIGKILL:  # after SIGKILL only the resource tracker may speak
        assert stderr.endswith("error: interrupted\n"), stderr
    _wait_until_gone(tag)


@pytest.mark.parametrize(
    ("signum", "code"),
    [
        pytest.param(signal.SIGTERM, 143, id="SIGTERM", marks=SLOW),
        pytest.param(signal.SIGINT, 130, id="SIGINT"),
    ],
)
def test_a_signal_to_a_single_process_cli_removes_its_staging(
    setup, tmp_path, channel, signum, code
):
    out, tag = tmp_path / "out", uuid.uuid4().hex
    proc = _start(setup, out, tag, channel, MUONCKPT_TEST_HOLD_PWRITE="1")
    _wait_until_writing(proc, channel, {"main"})
    stderr = _signal(proc, signum)
    assert (proc.returncode, stderr) == (code, "error: interrupted\n")
    _assert_nothing_left(tag, out)


def _start_committing(setup, tmp_path, tag: str, channel: Channel) -> tuple[subprocess.Popen, Path]:
    """``reshard --force`` over an existing checkpoint, held up just after its commit: the
    deletion of the replaced checkpoint's files is held. The command and its output."""
    out = tmp_path / "out"
    shutil.copytree(setup["src"], out)  # the checkpoint --force replaces (dp 1)
    proc = _start(setup, out, tag, channel, force=True, MUONCKPT_TEST_HOLD_UNLINK="1")
    what, _, _ = channel.next(proc)
    assert what == "cleaning"
    return proc, out


def _assert_committed(tag: str, out: Path) -> None:
    """The new checkpoint (dp 2) is whole at ``out``; no process is left; ``muonckpt clean``
    removes whatever is left of the replaced one."""
    import muonckpt

    _wait_until_gone(tag)
    assert muonckpt.verify(out) == []
    assert muonckpt.read_manifest(out).topology == {"dp": 2, "tp": 1}
    muonckpt.clean(out.parent, 0)
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".out")) == []


@pytest.mark.parametrize(
    ("signum", "code"),
    [
        pytest.param(signal.SIGTERM, 3, id="SIGTERM"),
        pytest.param(signal.SIGINT, 3, id="SIGINT", marks=SLOW),
    ],
)
def test_a_signal_after_the_commit_reports_committed(setup, tmp_path, channel, signum, code):
    """(issue 20) After the swap, SIGTERM/SIGINT printed "error: interrupted" (143/130) over a
    whole new checkpoint; now "committed: ..." and exit code 3."""
    tag = uuid.uuid4().hex
    proc, out = _start_committing(setup, tmp_path, tag, channel)
    stderr = _signal(proc, signum)
    assert proc.returncode == code, stderr
    done, committed = stderr.splitlines()[:2]  # the write's progress line (no terminal) first
    assert done.startswith("reshard: done, "), stderr
    assert committed.startswith(f"committed: {out} is complete; interrupted while cleaning up")
    _assert_committed(tag, out)
