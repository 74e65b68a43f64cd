"""`plan_prune`'s rules, on folder entries alone (no disk): what `trainckpt prune` keeps."""

from __future__ import annotations

import pytest

from trainckpt.errors import CheckpointNotFoundError, ConfigurationError
from trainckpt.format.folder_scan import FolderEntry
from trainckpt.retention.prune import plan_prune


def entry(name: str, state: str = "committed", ephemeral: bool | None = False) -> FolderEntry:
    step = int(name.removeprefix("step").removesuffix("-tmp"))
    return FolderEntry(
        name=name,
        path=f"/runs/{name}",
        step=step,
        state=state,  # type: ignore[arg-type]
        ephemeral=ephemeral if state == "committed" else None,
        size=step,
        files=6,
        created_at=None,
        world_size=1,
    )


def deleted(entries: list[FolderEntry], **kwargs: object) -> list[str]:
    plan = plan_prune("/runs", entries, **kwargs)  # type: ignore[arg-type]
    return [e.name for e in plan.to_delete]


def test_keeps_newest_permanent_deletes_older_ephemeral_and_leftovers():
    entries = [
        entry("step400-tmp", "tmp"),
        entry("step300"),
        entry("step100"),
        entry("step250", ephemeral=True),
        entry("step200"),
        entry("step350", "uncommitted"),
    ]
    assert deleted(entries, keep_last=2, keep_ephemeral=False) == [
        "step100",
        "step250",
        "step350",
        "step400-tmp",
    ]  # oldest first, whatever the listing order
    assert deleted(entries, keep_last=2, keep_ephemeral=True) == [
        "step100",
        "step350",
        "step400-tmp",
    ]
    plan = plan_prune("/runs", entries, keep_last=2, keep_ephemeral=False)
    assert plan.freed_bytes == 100 + 250 + 350 + 400


def test_newest_checkpoint_is_kept_even_when_ephemeral():
    entries = [entry("step100"), entry("step200", ephemeral=True), entry("step300", ephemeral=True)]
    assert deleted(entries, keep_last=1, keep_ephemeral=False) == ["step200"]


def test_more_to_keep_than_exist_deletes_only_leftovers():
    entries = [entry("step100"), entry("step200"), entry("step300-tmp", "tmp")]
    assert deleted(entries, keep_last=5, keep_ephemeral=False) == ["step300-tmp"]


def test_damaged_record_is_kept_for_a_human_to_look_at():
    entries = [entry("step100", "damaged"), entry("step200"), entry("step300")]
    plan = plan_prune("/runs", entries, keep_last=1, keep_ephemeral=False)
    assert [e.name for e in plan.to_delete] == ["step200"]
    kept = {d.entry.name: d.reason for d in plan.decisions if not d.delete}
    assert "damaged" in kept["step100"]


def test_a_damaged_newest_folder_never_costs_the_newest_good_checkpoint():
    # the newest good checkpoint is ephemeral: only "newest committed" keeps it
    entries = [entry("step100"), entry("step200", ephemeral=True), entry("step300", "damaged")]
    assert deleted(entries, keep_last=1, keep_ephemeral=False) == []


def test_refuses_folders_without_committed_checkpoints_and_bad_keep_last():
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        plan_prune("/runs", [entry("step5", "uncommitted")], keep_last=1, keep_ephemeral=False)
    with pytest.raises(CheckpointNotFoundError, match="no step folders"):
        plan_prune("/runs", [], keep_last=1, keep_ephemeral=False)
    with pytest.raises(ConfigurationError, match="--keep-last"):
        plan_prune("/runs", [entry("step5")], keep_last=0, keep_ephemeral=False)
