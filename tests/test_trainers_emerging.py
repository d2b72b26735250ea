"""The trainers tier for Emerging-Optimizers 0.3.0: ``AdaptiveMuon`` (``adamuon``, ``normuon``,
``namo``) and ``Muown`` (the cited port, ``tests/fixtures/emerging/muown.py``) from the package,
in the Python 3.12 venv it needs (the Megatron-Core venv of ``tests/fixtures/megatron``).

Run it with ``python -m pytest -m trainers -k emerging`` (not in the default run, not in CI).
The venv is ``$MUONCKPT_MEGATRON_VENV``, else the first of :data:`VENVS` that exists; without
one the test is skipped. ``make_fixtures.py --round-trip`` remakes the fixtures and, for each
optimizer, trains 3 steps at world 2 (gloo, an owner layout), saves, loads at world 1, at world 2
with the owners swapped and (where the shape rules allow) from a reshard to ``dp=1, tp=2``,
trains 2 more and compares with 5 uninterrupted steps bit for bit; namo's reshard must be
refused in one line naming the param and the key.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.trainers, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[1]
VENVS = (Path("~/.cache/muonckpt/megatron-core-0.19.2").expanduser(), Path("/work/mcvenv"))
"""Where a venv with emerging-optimizers 0.3.0 is looked for without ``$MUONCKPT_MEGATRON_VENV``."""


def _python() -> Path:
    named = os.environ.get("MUONCKPT_MEGATRON_VENV")
    for venv in [Path(named).expanduser()] if named else VENVS:
        if (venv / "bin" / "python").is_file():
            return venv / "bin" / "python"
    pytest.skip(f"no venv with emerging-optimizers 0.3.0 at {VENVS}")


def test_each_optimizer_resumes_at_another_world_and_layout_bitwise(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = REPO / "tests" / "fixtures" / "emerging" / "make_fixtures.py"
    done = subprocess.run(
        [str(_python()), str(script), str(tmp_path), "--round-trip"],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=REPO,
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["ok"] and done.returncode == 0, (result["failures"], done.stderr[-4000:])
    for kind in ("adamuon", "normuon", "muown"):
        assert sum(c.startswith(f"{kind} resumed") for c in result["checks"]) == 3, kind
    assert sum(c.startswith("namo resumed") for c in result["checks"]) == 2
    assert any(c.startswith("namo: reshard refused") for c in result["checks"])
