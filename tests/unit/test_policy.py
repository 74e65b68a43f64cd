"""`CheckpointPolicy`: validation and the pure save / retention decisions (no disk)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainckpt import CheckpointPolicy, ConfigurationError
from trainckpt.retention.policy import CheckpointInfo, Leftover, SaveKind

P, E = SaveKind.PERMANENT, SaveKind.EPHEMERAL


def infos(*items: tuple[int, bool]) -> list[CheckpointInfo]:
    return [CheckpointInfo(step, f"/ckpts/step{step}", eph) for step, eph in items]


def steps(ckpts: list[CheckpointInfo]) -> list[int]:
    return [c.step for c in ckpts]


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, named",
    [
        (
            {"save_interval": 10, "ephemeral_save_interval": 10},
            ["ephemeral_save_interval", "save_interval"],
        ),
        (
            {"save_interval": 10, "ephemeral_save_interval": 20},
            ["ephemeral_save_interval", "save_interval"],
        ),
        ({"max_checkpoints": 2, "remove": "never"}, ["max_checkpoints", "remove"]),
        ({"ephemeral_cooldown": 3}, ["ephemeral_cooldown", "ephemeral_save_interval"]),
        ({"fixed_steps": [5, -1]}, ["fixed_steps"]),
        ({"save_interval": 0}, ["save_interval"]),
        ({"max_checkpoints": 0}, ["max_checkpoints"]),
        ({"remove": "everything"}, ["remove"]),
        ({"save_intervall": 10}, ["save_intervall"]),
    ],
)
def test_invalid_combinations_are_refused_naming_the_fields(fields: dict, named: list[str]) -> None:
    with pytest.raises(ConfigurationError) as info:
        CheckpointPolicy.validated(fields, where="configs/x.yaml")
    msg = str(info.value)
    assert "configs/x.yaml" in msg
    for name in named:
        assert name in msg
    with pytest.raises(ValidationError):
        CheckpointPolicy(**fields)


def test_valid_policy_from_a_mapping() -> None:
    policy = CheckpointPolicy.validated(
        {
            "save_interval": 10,
            "ephemeral_save_interval": 5,
            "fixed_steps": [7],
            "max_checkpoints": 2,
        }
    )
    assert policy.fixed_steps == (7,)
    assert policy.save_async is True and policy.remove == "ephemeral_only"


# -- save decisions ---------------------------------------------------------------------------


def test_decide_intervals_fixed_steps_and_pre_train() -> None:
    policy = CheckpointPolicy(save_interval=10, ephemeral_save_interval=4, fixed_steps=(7,))
    got = {s: policy.decide(s, None) for s in range(0, 21)}
    assert {s for s, k in got.items() if k is P} == {0, 7, 10, 20}
    assert {s for s, k in got.items() if k is E} == {4, 8, 12, 16}
    assert CheckpointPolicy(pre_train_checkpoint=False).decide(0, None) is None


def test_ephemeral_cooldown_counts_from_the_last_checkpoint() -> None:
    policy = CheckpointPolicy(save_interval=10, ephemeral_save_interval=2, ephemeral_cooldown=3)
    assert policy.decide(12, last_saved_step=10) is None  # 2 steps after a checkpoint
    assert policy.decide(14, last_saved_step=10) is E  # 4 steps after
    assert policy.decide(2, last_saved_step=None) is E
    assert policy.decide(20, last_saved_step=18) is P  # cooldown never blocks permanent ones


# -- retention --------------------------------------------------------------------------------


def test_only_the_newest_ephemeral_is_kept_and_only_once_superseded() -> None:
    policy = CheckpointPolicy(save_interval=10, ephemeral_save_interval=5)
    assert policy.to_delete(infos((10, False), (15, True))) == []
    assert steps(policy.to_delete(infos((10, False), (15, True), (20, False)))) == [15]
    assert steps(policy.to_delete(infos((5, True), (10, True), (15, True)))) == [5, 10]


def test_ephemeral_flag_not_step_arithmetic_decides() -> None:
    # Steps 3 and 6 fit neither interval of this policy, yet 3 is permanent by its metadata.
    policy = CheckpointPolicy(save_interval=100, ephemeral_save_interval=50)
    assert steps(policy.to_delete(infos((3, False), (6, True), (9, True)))) == [6]


def test_max_checkpoints_spares_step0_and_fixed_steps() -> None:
    policy = CheckpointPolicy(save_interval=10, fixed_steps=(15,), max_checkpoints=2)
    ckpts = infos((0, False), (10, False), (15, False), (20, False), (30, False), (40, False))
    assert steps(policy.to_delete(ckpts)) == [10, 20]


def test_newest_checkpoint_is_never_deleted() -> None:
    policy = CheckpointPolicy(save_interval=10, max_checkpoints=1)
    assert policy.to_delete(infos((40, True))) == []
    # The newest is ephemeral: the permanent one before it is trimmed only beyond the limit.
    assert steps(policy.to_delete(infos((10, False), (20, False), (25, True)))) == [10]


def test_remove_never_keeps_everything() -> None:
    policy = CheckpointPolicy(save_interval=10, ephemeral_save_interval=5, remove="never")
    assert policy.to_delete(infos((5, True), (10, False), (15, True), (20, False))) == []


def test_leftovers_only_with_all_non_permanent_and_only_older_than_the_newest() -> None:
    leftovers = [
        Leftover(5, "/ckpts/step5-tmp"),
        Leftover(12, "/ckpts/step12"),
        Leftover(30, "/ckpts/step30-tmp"),
    ]
    committed = infos((10, False), (20, False))
    eph_only = CheckpointPolicy(save_interval=10)
    everything = CheckpointPolicy(save_interval=10, remove="all_non_permanent")
    assert eph_only.leftovers_to_delete(leftovers, committed) == []
    assert [x.step for x in everything.leftovers_to_delete(leftovers, committed)] == [5, 12]
    assert everything.leftovers_to_delete(leftovers, []) == []
