"""tools/fa4_parts.sh: FA4's wheels from ../shared/tools/fa4_wheels.sh's two folders, re-cut into three that each fit
a device call's carry; the device side (the parts copied into a stage folder, activate.sh sourced) must give back
exactly the wheels, the split cu13 wheel joined. Small stand-in files and a stub pip, so it runs anywhere."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fa4_parts.sh"
CU13 = "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl"


def _fake_peers(root: Path) -> dict[str, bytes]:
    """fa4_wheels.sh's layout with random contents: .peers1 the small wheels and the cu13 wheel's first half,
    .peers2 its second half and the activate.sh that names it. Returns the wheels as the device must get them."""
    rng = random.Random(7)
    wheels = {f"pkg{i}-1.0-py3-none-any.whl": rng.randbytes(3000 + 977 * i) for i in range(3)}
    big = rng.randbytes(9001)
    p1, p2 = root / ".peers1", root / ".peers2"
    p1.mkdir()
    p2.mkdir()
    for name, data in wheels.items():
        (p1 / name).write_bytes(data)
    (p1 / "cu13part_aa").write_bytes(big[:5000])
    (p2 / "cu13part_ab").write_bytes(big[5000:])
    (p2 / "activate.sh").write_text(f"cat /tmp/fa4/cu13part_aa .peers2/cu13part_ab > /tmp/fa4/{CU13}\n")
    return {**wheels, CU13: big}


def _run(root: Path, part_bytes: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PART_BYTES": str(part_bytes)}
    return subprocess.run(["bash", str(TOOL)], cwd=root, env=env, capture_output=True, text=True, timeout=60)


def test_parts_give_back_the_wheels(tmp_path):
    want = _fake_peers(tmp_path)
    res = _run(tmp_path, part_bytes=14000)
    assert res.returncode == 0, res.stderr
    folders = [tmp_path / f".peers{f}" for f in "ABC"]
    assert all(f.is_dir() for f in folders)
    for f in folders:
        assert sum(p.stat().st_size for p in f.iterdir() if p.name.startswith("fa4p_")) <= 14000
    assert not (folders[0] / "activate.sh").exists() and (folders[2] / "activate.sh").exists()
    # the device: calls 1 and 2 copy their parts into the stage, call 3 sources activate.sh (pip stubbed to a copy)
    stage, site = tmp_path / "stage", tmp_path / "site"
    stage.mkdir()
    for f in folders[:2]:
        for p in f.iterdir():
            (stage / p.name).write_bytes(p.read_bytes())
    pip = tmp_path / "pip_stub.sh"  # stands for `python3 -m pip`: copies the wheels it is given into the site
    pip.write_text(f'#!/bin/sh\nmkdir -p "{site}"\nfor a; do case "$a" in *.whl) cp "$a" "{site}/";; esac; done\n')
    pip.chmod(0o755)
    env = {**os.environ, "FA4_STAGE": str(stage), "FA4_SITE": str(site), "FA4_PIP": str(pip), "PYTHONPATH": ""}
    res = subprocess.run(["bash", "-c", f"source {folders[2]}/activate.sh && echo $PYTHONPATH"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split(":")[0] == str(site)
    got = {p.name: p.read_bytes() for p in site.iterdir()}
    assert got == want


def test_too_many_parts_is_refused(tmp_path):
    _fake_peers(tmp_path)
    res = _run(tmp_path, part_bytes=4000)
    assert res.returncode == 2
    assert "more than the 3 folders" in res.stderr
    assert not any((tmp_path / f".peers{f}").exists() for f in "ABC")


def test_missing_wheel_name_is_refused(tmp_path):
    _fake_peers(tmp_path)
    (tmp_path / ".peers2" / "activate.sh").write_text("nothing here\n")
    res = _run(tmp_path, part_bytes=14000)
    assert res.returncode == 2
    assert "names no nvidia_cutlass_dsl_libs_cu13 wheel" in res.stderr


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
