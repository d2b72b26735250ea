"""Every benchmark script has a smoke run (issue 36): ``benchmarks/smoke.py`` lists it, and
``.ci/run`` runs that list after the suite, so a renamed function can never break a benchmark
unnoticed. The smoke runs themselves start processes for a minute and are not repeated here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def _smoke_module():
    spec = importlib.util.spec_from_file_location("benchmark_smoke", BENCHMARKS / "smoke.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_script_has_a_smoke_run() -> None:
    smoke = _smoke_module()
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    listed = set(smoke.SMOKE) | set(smoke.NEEDS_A_TRAINER) | smoke.RUN_BY_OTHERS | smoke.HELPERS
    assert scripts == listed, (sorted(scripts - listed), sorted(listed - scripts))
    assert not set(smoke.SMOKE) & set(smoke.NEEDS_A_TRAINER)


def test_the_scripts_run_by_others_are_run_by_run_py() -> None:
    source = (BENCHMARKS / "run.py").read_text()
    for name in _smoke_module().RUN_BY_OTHERS:
        assert f'_run("{name}"' in source, name


def test_ci_runs_the_smoke_after_the_suite() -> None:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    suite = next(i for i, line in enumerate(lines) if "python -m pytest" in line)
    smoke = next(i for i, line in enumerate(lines) if "benchmarks/smoke.py" in line)
    assert smoke > suite


def test_workdir_is_made_or_refused_in_one_line(tmp_path) -> None:
    """(issue 57) ``--workdir DIR`` of a missing DIR ended in a traceback."""
    spec = importlib.util.spec_from_file_location("benchmark_common", BENCHMARKS / "common.py")
    assert spec is not None and spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    made = tmp_path / "new" / "dir"
    assert common.make_workdir(str(made)) == str(made) and made.is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as refused:
        common.make_workdir(str(tmp_path / "file" / "dir"))
    assert str(refused.value) == f"--workdir {tmp_path / 'file' / 'dir'}: Not a directory"
    for script in (
        "run.py",
        "bench_async.py",
        "bench_checkpoint.py",
        "bench_offline.py",
        "bench_scale.py",
    ):
        assert "type=make_workdir" in (BENCHMARKS / script).read_text(), script
