"""The A/B tools' host-side parts, which the device calls rely on and CI can run: tools/patched_tree.sh (the patched
copies of the tree that the A/B scripts build), the tree step of v2_partitioning/tools/ab_sparse.sh and
v3_hopper/tools/ab_patches.sh (DRY_RUN=1), and the two summaries (ab_sparse_summary.py, v3's ab_summary.py), on
made-up rows whose every value differs, so that a value read from the wrong row or round changes the result."""
from __future__ import annotations

import difflib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TARGET = "tools/patched_tree.sh"  # the file the test patches edit (in the copies only)

pytestmark = pytest.mark.skipif(shutil.which("patch") is None or shutil.which("bash") is None,
                                reason="needs bash and patch")


def _load(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, _ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _patch(old: list[str], new: list[str]) -> str:
    return "".join(difflib.unified_diff(old, new, f"a/{_TARGET}", f"b/{_TARGET}"))


@pytest.fixture
def patches(tmp_path):
    """Two patches of _TARGET: `one` inserts a line after the first, `two` rewrites that line, so it applies only
    after `one` (order matters)."""
    lines = (_ROOT / _TARGET).read_text().splitlines(keepends=True)
    one = lines[:1] + ["# patched: one\n"] + lines[1:]
    two = lines[:1] + ["# patched: two\n"] + lines[1:]
    p1, p2 = tmp_path / "one.patch", tmp_path / "two.patch"
    p1.write_text(_patch(lines, one))
    p2.write_text(_patch(one, two))
    return p1, p2


def _run(args, tmp_path, **env):
    return subprocess.run(["bash", *map(str, args)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_patched_tree_applies_patches_in_order(patches, tmp_path):
    p1, p2 = patches
    before = (_ROOT / _TARGET).read_text()
    dst = tmp_path / "trees" / "both"
    # the first patch by a path relative to the repository root, the second absolute: both forms are accepted
    r = _run([_ROOT / "tools/patched_tree.sh", dst, os.path.relpath(p1, _ROOT), p2], tmp_path)
    assert r.returncode == 0, r.stderr
    text = (dst / _TARGET).read_text()
    assert "# patched: two\n" in text and "# patched: one" not in text
    assert text.replace("# patched: two\n", "", 1) == before
    assert (_ROOT / _TARGET).read_text() == before  # the tree itself is untouched
    assert (dst / "README.md").read_bytes() == (_ROOT / "README.md").read_bytes()
    assert not (dst / ".git").exists()


def test_patched_tree_refuses_a_patch_that_does_not_apply(patches, tmp_path):
    p1, p2 = patches
    r = _run([_ROOT / "tools/patched_tree.sh", tmp_path / "t", p2], tmp_path)
    assert r.returncode == 2
    assert f"{p2} does not apply" in r.stderr
    # a patch whose first file applies and whose second does not: checked whole first (--dry-run), nothing applied
    readme = (_ROOT / "README.md").read_text().splitlines(keepends=True)[:3]
    half = tmp_path / "half.patch"
    half.write_text(p1.read_text() + "".join(difflib.unified_diff(
        ["not README's line\n"] + readme, readme, "a/README.md", "b/README.md")))
    r = _run([_ROOT / "tools/patched_tree.sh", tmp_path / "t", half], tmp_path)
    assert r.returncode == 2 and f"{half} does not apply" in r.stderr
    assert (tmp_path / "t" / _TARGET).read_text() == (_ROOT / _TARGET).read_text()


@pytest.mark.parametrize("dst", ["", "{root}", "{root}/", "{root}/tools/..", "{root}/.."])
def test_patched_tree_refuses_to_empty_the_tree(dst, tmp_path):
    # on a copy of the script in a tree of its own (it copies the tree it sits in), so a broken guard empties that
    root = tmp_path / "tree"
    (root / "tools").mkdir(parents=True)
    shutil.copy(_ROOT / "tools/patched_tree.sh", root / "tools")
    (root / "kept.txt").write_text("kept\n")
    r = _run([root / "tools/patched_tree.sh", dst.format(root=root)], tmp_path)
    assert r.returncode == 2
    assert (root / "kept.txt").read_text() == "kept\n" and (root / "tools/patched_tree.sh").is_file()


def test_ab_sparse_dry_run_makes_the_trees(patches, tmp_path):
    p1, p2 = patches
    trees = tmp_path / "trees"
    r = _run([_ROOT / "v2_partitioning/tools/ab_sparse.sh", "base", f"two={p1}+{p2}"], tmp_path, DRY_RUN="1",
             TREES=str(trees), OUT=str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert f"ab_sparse: trees base two under {trees}" in r.stdout
    assert (trees / "base" / _TARGET).read_text() == (_ROOT / _TARGET).read_text()
    assert "# patched: two\n" in (trees / "two" / _TARGET).read_text()

    bad = _run([_ROOT / "v2_partitioning/tools/ab_sparse.sh", "base", f"two={p2}"], tmp_path, DRY_RUN="1",
               TREES=str(trees), OUT=str(tmp_path / "out"))
    assert bad.returncode == 2 and "does not apply" in bad.stderr
    none = _run([_ROOT / "v2_partitioning/tools/ab_sparse.sh"], tmp_path, DRY_RUN="1", TREES=str(trees),
                OUT=str(tmp_path / "out"))
    assert none.returncode == 2 and "name at least one tree" in none.stderr


def test_ab_patches_dry_run_names_each_tree(patches, tmp_path):
    p1, _ = patches
    trees = tmp_path / "trees"
    r = _run([_ROOT / "v3_hopper/tools/ab_patches.sh", "base", f"one={p1}"], tmp_path, DRY_RUN="1", TREES=str(trees))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["bash", f"{_ROOT}/v3_hopper/tools/ab_v3.sh", f"base={_ROOT}", f"one={trees}/one"]
    assert "# patched: one\n" in (trees / "one" / _TARGET).read_text()


def _sparse_row(label, ms, ratio=None, layout="random:0.1", mode="bwd", d=128, s=8192):
    row = dict(label=label, head_dim=d, seqlen=s, batch=2, heads=16, layout=layout,
               order="-" if ratio is None else "heavy-first", mode=mode, ms=ms)
    if ratio is not None:
        row["ratio"] = ratio
    return json.dumps(row)


def test_ab_sparse_summary_min_max_ratio_and_change():
    summary = _load("ab_sparse_summary", "v2_partitioning/tools/ab_sparse_summary.py")
    lines = [
        _sparse_row("base-r1", 1.40, 1.38), _sparse_row("walk-r1", 1.30, 1.29),
        _sparse_row("base-r2", 1.36, 1.34), _sparse_row("walk-r2", 1.33, 1.31),
        _sparse_row("base-r1", 9.10, layout="dense"), _sparse_row("walk-r1", 9.20, layout="dense"),
        _sparse_row("other-r1", 0.50, 0.49),  # a tree not asked for
        _sparse_row("base", 0.40, 0.39),      # a label without its round
        "",
        _sparse_row("walk-r1", 0.70, 0.69, mode="fwd"),  # a row the first tree does not have
    ]
    out = summary.summarize(lines, ["base", "walk"])
    assert out[0].split()[-2:] == ["vs", "base"]
    rows = [line.split() for line in out[1:]]
    assert rows == [
        ["128", "8192", "random:0.1", "heavy-first", "bwd", "base", "2", "1.3600", "1.4000", "1.340"],
        ["128", "8192", "random:0.1", "heavy-first", "bwd", "walk", "2", "1.3000", "1.3300", "1.290", "-4.4%"],
        ["128", "8192", "dense", "-", "bwd", "base", "1", "9.1000", "9.1000"],
        ["128", "8192", "dense", "-", "bwd", "walk", "1", "9.2000", "9.2000", "+1.1%"],
        ["128", "8192", "random:0.1", "heavy-first", "fwd", "walk", "1", "0.7000", "0.7000", "0.690"],
    ]


def test_ab_summary_v3_medians(tmp_path, capsys):
    ab_summary = _load("ab_summary", "v3_hopper/tools/ab_summary.py")
    rows = [dict(label=lab, head_dim=128, seqlen=8192, causal=False, v3=v3, cudnn=cudnn)
            for lab, v3, cudnn in [("main", 600, 500), ("pipe", 620, 500), ("main", 610, 520), ("pipe", 590, 520),
                                   ("main", 580, 480), ("pipe", 640, 510)]]
    rows.append(dict(label="pipe", head_dim=64, seqlen=512, causal=True, v3=300, cudnn=None))  # no peer: left out
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ab_summary.main(str(path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["config", "main", "pipe"]
    assert len(lines) == 2
    # main: 600/500 1.2, 610/520 1.173, 580/480 1.208 -> median 1.200; pipe: 1.24, 1.135, 1.255 -> 1.240
    assert lines[1].split() == ["d128", "s8192", "full", "600/610/580", "(1.200)", "620/590/640", "(1.240)"]
