"""The real CLI with ``--workers 2``, interrupted by real signals: no process outlives it.

Each test runs ``python -m muonckpt.cli reshard SRC --dp 2 --tp 1 -o OUT --workers 2`` in a
subprocess whose environment carries a tag that every process it starts inherits (the
forkserver, the resource tracker, the workers), so the processes it left can be found in
/proc after it is gone, whoever their parent is by then. A ``sitecustomize`` module on
PYTHONPATH slows every ``os.pwrite`` by 0.2 s, so the workers are reliably in the middle of
writing when the signal comes (or, with a rank named, makes that rank's writes fail).
Afterwards: no tagged process within 10 s, no OUT, nothing staged beside it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

SITECUSTOMIZE = """
import os

_delay = float(os.environ.get("MUONCKPT_TEST_PWRITE_DELAY") or 0)
_fail = os.environ.get("MUONCKPT_TEST_PWRITE_FAIL_RANK")
if _delay or _fail:
    import time

    _pwrite = os.pwrite

    def pwrite(fd, data, offset):
        if _fail is not None and os.environ.get("RANK") == _fail:
            raise RuntimeError("injected pwrite failure")
        time.sleep(_delay)
        return _pwrite(fd, data, offset)

    os.pwrite = pwrite

_unlink_rank = os.environ.get("MUONCKPT_TEST_UNLINK_RANK")
if _unlink_rank is not None:  # "0": worker rank 0, "main": a process without RANK
    import time

    _unlink = os.unlink

    def unlink(path, *args, **kwargs):
        name = os.fsdecode(path)
        ours = name.endswith(".safetensors") or name.endswith("manifest.json")
        if ours and os.environ.get("RANK", "main") == _unlink_rank:
            with open(os.environ["MUONCKPT_TEST_PIDFILE"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(5)
        return _unlink(path, *args, **kwargs)

    os.unlink = unlink
"""


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
    setup, out: Path, tag: str, *extra: str, workers: int = 2, force: bool = False, **env: str
) -> subprocess.Popen:
    path = os.pathsep.join([str(setup["site"]), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "muonckpt.cli", *extra, "reshard", str(setup["src"])]
    command += ["--dp", "2", "--tp", "1", "-o", str(out), "--workers", str(workers)]
    command += ["--force"] if force else []
    return subprocess.Popen(
        command,
        env={**os.environ, "MUONCKPT_TEST_TAG": tag, "PYTHONPATH": path, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_until_writing(proc: subprocess.Popen, out: Path, timeout: float = 60.0) -> None:
    """Until a staging directory beside ``out`` holds the workers' .part files."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for entry in out.parent.glob(f".{out.name}.staging-*"):
            if any(p.name.endswith(".part") for p in entry.iterdir()):
                time.sleep(0.3)  # well inside the writing: each pwrite takes 0.2 s
                return
        time.sleep(0.02)
    raise AssertionError("the workers never started writing")


def _assert_nothing_left(tag: str, out: Path) -> None:
    """Within 10 s: no tagged process, no OUT, nothing named .OUT.* beside it."""
    deadline = time.monotonic() + 10
    while (_tagged(tag) or list(out.parent.glob(f".{out.name}.*"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _tagged(tag) == {}, _tagged(tag)
    assert not out.exists()
    assert list(out.parent.glob(f".{out.name}.*")) == []


def _workers(tag: str) -> list[int]:
    """The worker processes: tagged children of the tagged forkserver."""
    procs = _tagged(tag)
    servers = {pid for pid, cmd in procs.items() if "forkserver" in cmd}
    return sorted(pid for pid in procs if _parent_pid(pid) in servers)


def _signal(proc: subprocess.Popen, signum: int) -> str:
    """Send ``signum`` and wait for the command to end; its stderr (killed if it hangs)."""
    try:
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return stderr


@pytest.mark.parametrize(
    ("signum", "code"),
    [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 143), (signal.SIGINT, 130)],
    ids=["SIGKILL", "SIGTERM", "SIGINT"],
)
def test_a_signal_to_the_cli_leaves_no_process_and_no_output(setup, tmp_path, signum, code):
    out, tag = tmp_path / "out", uuid.uuid4().hex
    proc = _start(setup, out, tag, MUONCKPT_TEST_PWRITE_DELAY="0.2")
    try:
        _wait_until_writing(proc, out)
        assert len(_workers(tag)) == 2
    except BaseException:
        _signal(proc, signal.SIGKILL)
        raise
    stderr = _signal(proc, signum)
    assert proc.returncode == code, stderr
    if signum != signal.SIGKILL:  # after SIGKILL only the resource tracker may speak
        assert stderr == "error: interrupted\n"
    _assert_nothing_left(tag, out)


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"]
)
def test_a_signal_to_a_single_process_cli_removes_its_staging(setup, tmp_path, signum, code):
    out, tag = tmp_path / "out", uuid.uuid4().hex
    proc = _start(setup, out, tag, workers=1, MUONCKPT_TEST_PWRITE_DELAY="0.2")
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob(".out.staging-*/.*.tmp-*")):  # a file being written
        assert proc.poll() is None and time.monotonic() < deadline, _signal(proc, signal.SIGKILL)
        time.sleep(0.02)
    stderr = _signal(proc, signum)
    assert (proc.returncode, stderr) == (code, "error: interrupted\n")
    _assert_nothing_left(tag, out)


def test_a_killed_worker_is_one_short_line(setup, tmp_path):
    out, tag = tmp_path / "out", uuid.uuid4().hex
    proc = _start(setup, out, tag, MUONCKPT_TEST_PWRITE_DELAY="0.2")
    try:
        _wait_until_writing(proc, out)
        victim = _workers(tag)[-1]
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 200, stderr
    assert "was killed by SIGKILL" in lines[0], stderr
    _assert_nothing_left(tag, out)


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_a_failing_worker_is_one_line_and_debug_shows_the_traceback(setup, tmp_path, debug):
    out, tag = tmp_path / "out", uuid.uuid4().hex
    extra = ("--debug",) if debug else ()
    proc = _start(setup, out, tag, *extra, MUONCKPT_TEST_PWRITE_FAIL_RANK="1")
    try:
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if debug:
        assert proc.returncode == 2 and "Traceback" in stderr, stderr
        assert "rank 1: RuntimeError: injected pwrite failure" in stderr
    else:
        assert proc.returncode == 2, stderr
        (line,) = stderr.strip().splitlines()
        assert line.startswith(
            "error: reshard (write): rank 1: RuntimeError: injected pwrite failure"
        ), line
        assert len(line) < 300
    _assert_nothing_left(tag, out)
    shutil.rmtree(tmp_path, ignore_errors=True)


def _start_committing(setup, tmp_path, tag: str, workers: int) -> tuple[subprocess.Popen, Path]:
    """``reshard --force`` over an existing checkpoint, held up just after its commit: the
    deletion of the replaced checkpoint's files (by rank 0, or the single process) sleeps."""
    out, pidfile = tmp_path / "out", tmp_path / "pid"
    shutil.copytree(setup["src"], out)  # the checkpoint --force replaces (dp 1)
    rank = "0" if workers > 1 else "main"
    env = {"MUONCKPT_TEST_UNLINK_RANK": rank, "MUONCKPT_TEST_PIDFILE": str(pidfile)}
    proc = _start(setup, out, tag, workers=workers, force=True, **env)
    deadline = time.monotonic() + 90
    while not pidfile.exists() or not pidfile.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, _signal(proc, signal.SIGKILL)
        time.sleep(0.02)
    return proc, out


def _assert_committed(tag: str, out: Path) -> None:
    """The new checkpoint (dp 2) is whole at ``out``; no process is left; ``muonckpt clean``
    removes whatever is left of the replaced one."""
    import muonckpt

    deadline = time.monotonic() + 10
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _tagged(tag) == {}
    assert muonckpt.verify(out) == []
    assert muonckpt.read_manifest(out).topology == {"dp": 2, "tp": 1}
    muonckpt.clean(out.parent, 0)
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".out")) == []


@pytest.mark.parametrize("workers", [2, 1], ids=["workers", "single"])
@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, 3), (signal.SIGINT, 3)], ids=["SIGTERM", "SIGINT"]
)
def test_a_signal_after_the_commit_reports_committed(setup, tmp_path, signum, code, workers):
    """(issue 20) After the swap, SIGTERM/SIGINT printed "error: interrupted" (143/130) over a
    whole new checkpoint; now "committed: ..." and exit code 3."""
    tag = uuid.uuid4().hex
    proc, out = _start_committing(setup, tmp_path, tag, workers)
    stderr = _signal(proc, signum)
    assert proc.returncode == code, stderr
    assert stderr.startswith(f"committed: {out} is complete; interrupted while cleaning up"), stderr
    _assert_committed(tag, out)


def test_a_worker_killed_after_the_commit_reports_success(setup, tmp_path):
    """(issue 20) SIGKILL of worker rank 0 after the swap gave exit 2; the output is whole,
    so the command succeeds, with a warning naming the death."""
    tag = uuid.uuid4().hex
    proc, out = _start_committing(setup, tmp_path, tag, workers=2)
    try:
        os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert stderr.startswith(f"warning: committed {out}, but then:"), stderr
    assert "SIGKILL" in stderr, stderr
    _assert_committed(tag, out)
