"""pygmy.experiments.ab: the other version runs from a worktree of its own, removed afterwards."""

from __future__ import annotations

import subprocess

from pygmy.cluster.local import ROOT
from pygmy.experiments.ab import checkout


def test_a_revision_is_checked_out_beside_this_tree_and_removed_afterwards() -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with checkout("HEAD") as tree:
        assert tree != ROOT
        assert (tree / "pygmy" / "cluster" / "local.py").is_file()
        at = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
        assert at == head
    assert not tree.exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(tree) not in listed
    with checkout(None) as here:
        assert here == ROOT
