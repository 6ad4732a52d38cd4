"""A rank's torch.save to a path replaces the file whole (baton/worker/whole_saves.py):
a successor's resume block reading the checkpoint while rank 0 writes it sees the old one or
the new one, never a truncated archive."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from baton.worker import whole_saves


@pytest.fixture
def whole(monkeypatch):
    monkeypatch.setattr(torch, "save", torch.save)  # put back after the test
    whole_saves.install()


class _ReadsWhileSaved:
    """Pickled by torch.save after it opened its destination: what a reader finds there then."""

    def __init__(self, path):
        self.path, self.seen = path, []

    def __reduce__(self):
        try:
            self.seen.append(torch.load(self.path))
        except Exception as exc:  # noqa: BLE001 - what a resume block would die of
            self.seen.append(exc)
        return (int, (0,))


def test_a_checkpoint_being_saved_reads_whole_as_the_old_one(tmp_path, whole):
    path = tmp_path / "ckpt.pt"
    torch.save({"step": torch.tensor(1)}, path)
    probe = _ReadsWhileSaved(path)
    torch.save({"step": torch.tensor(2), "probe": probe}, path)
    assert probe.seen and isinstance(probe.seen[0], dict) and probe.seen[0]["step"].item() == 1, probe.seen
    assert torch.load(path, weights_only=False)["step"].item() == 2
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left


def test_without_it_the_reader_finds_a_truncated_file(tmp_path):
    """The hazard itself, with torch's own save (so the test above proves something)."""
    path = tmp_path / "ckpt.pt"
    torch.save({"step": torch.tensor(1)}, path)
    probe = _ReadsWhileSaved(path)
    torch.save({"step": torch.tensor(2), "probe": probe}, path)
    assert isinstance(probe.seen[0], Exception), probe.seen


def test_bytes_permissions_and_other_destinations_are_the_scripts(tmp_path, whole):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"old")
    path.chmod(0o600)
    torch.save({"w": torch.arange(4)}, str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    plain = tmp_path / "plain.pt"
    torch.save.__wrapped__({"w": torch.arange(4)}, plain)
    assert torch.equal(torch.load(path)["w"], torch.load(plain)["w"])
    torch.save({"w": torch.arange(4)}, os.devnull)  # not a regular file: written as asked
    with open(tmp_path / "handle.pt", "wb") as f:  # an open handle: the script's own
        torch.save({"w": torch.arange(4)}, f)
    assert torch.load(tmp_path / "handle.pt")["w"].tolist() == [0, 1, 2, 3]


def test_a_failed_save_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path, whole):
    path = tmp_path / "ckpt.pt"
    torch.save({"step": torch.tensor(1)}, path)
    with pytest.raises(Exception):
        torch.save({"bad": lambda: 0}, path)  # lambdas do not pickle
    assert torch.load(path)["step"].item() == 1 and os.listdir(tmp_path) == ["ckpt.pt"]
