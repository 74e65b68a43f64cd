"""`ModelAndOptim`'s plain walk (`trainckpt.plain_state`) gives exactly DCP's state dicts and,
after a load, exactly the model and optimizer DCP's `set_*_state_dict` leave; anything it
cannot be sure of goes through DCP."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from trainckpt import CheckpointerConfig, ModelAndOptim, plain_state
from trainckpt.errors import CheckpointError
from trainckpt.train_module import _HandedOut

OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
PLAIN = "state dicts from a plain walk"
DCP = "state dicts from DCP"

Parts = tuple[list[nn.Module], list[torch.optim.Optimizer], list[Any]]


class Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("kept", torch.arange(4.0))
        self.register_buffer("dropped", torch.ones(4), persistent=False)
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))
        self.register_buffer("nothing", None)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


class Shared(nn.Module):
    """One submodule under two names (state_dict lists it twice, named_parameters once)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(nn.ReLU(), self.a)


class Extra(nn.Linear):
    """A module with extra state (a counter and a tensor), as Transformer Engine's have."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.calls = 5
        self.scale = torch.full((2,), 0.5)

    def get_extra_state(self) -> Any:
        return {"calls": self.calls, "scale": self.scale.clone()}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]
        self.scale = state["scale"]


def _train(params: list[nn.Parameter], optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        optim.step()
        optim.zero_grad(set_to_none=True)


def _mlp(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


def _buffers(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = Buffers()
    if seed:
        m.kept.add_(seed)
        m.count.add_(seed)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


def _tied(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = Tied()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


def _shared(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = Shared()
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


def _frozen(seed: int, steps: int) -> Parts:
    """Frozen parameters in the optimizer, and a trainable one that never gets a gradient."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    m[0].requires_grad_(False)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train([m[1].weight, m[2].weight, m[2].bias], o, steps, seed)  # m[1].bias: no state
    return [m], [o], []


def _two_groups(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    o = torch.optim.AdamW(
        [
            {"params": m[0].parameters(), "lr": 1e-2, "weight_decay": 0.0},
            {"params": m[1].parameters(), "lr": 3e-3, "betas": (0.8, 0.9)},
        ],
        lr=1e-3,
    )
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


def _sgd(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    o = torch.optim.SGD(m.parameters(), lr=0.1)  # no momentum: no state at all
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


def _amsgrad(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    o = torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, weight_decay=0.01)
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


def _scheduled(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    for i in range(steps):
        _train(list(m.parameters()), o, 1, seed + i)
        sched.step()
    return [m], [o], [sched]


def _extra(seed: int, steps: int) -> Parts:
    torch.manual_seed(seed)
    m = nn.Sequential(Extra(), nn.Linear(4, 4))
    m[0].calls += seed
    m[0].scale += seed
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


def _pipeline(seed: int, steps: int) -> Parts:
    """Two stages keeping their original names, one optimizer each (different kinds)."""
    torch.manual_seed(seed)
    full = nn.ModuleDict({"embed": nn.Embedding(8, 4), "out": nn.Linear(4, 8)})
    first, second = nn.ModuleDict({"embed": full.embed}), nn.ModuleDict({"out": full.out})
    o1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    o2 = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.5)
    _train(list(first.parameters()), o1, steps, seed)
    _train(list(second.parameters()), o2, steps, seed + 1)
    return [first, second], [o1, o2], []


CASES: dict[str, Callable[[int, int], Parts]] = {
    "mlp": _mlp,
    "buffers": _buffers,
    "tied": _tied,
    "shared_module": _shared,
    "frozen_and_gradless": _frozen,
    "two_groups": _two_groups,
    "sgd_no_momentum": _sgd,
    "adam_amsgrad": _amsgrad,
    "lr_scheduler": _scheduled,
    "extra_state": _extra,
    "pipeline": _pipeline,
}


def _debug(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """`caplog` recording train_module's debug lines (which path each part took). Called in
    the test itself: a level set in a fixture applies to the setup phase only."""
    caplog.set_level(logging.DEBUG, logger="trainckpt.train_module")
    return caplog


@pytest.fixture
def force_dcp(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """`force_dcp(True)` makes every part go through DCP, as a module the walk rejects."""
    real = plain_state.walk

    def switch(on: bool) -> None:
        monkeypatch.setattr(plain_state, "walk", (lambda m: "forced") if on else real)

    return switch


def _same_value(a: Any, b: Any, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.device) == (b.dtype, b.shape, b.stride(), b.device)
        assert a.requires_grad == b.requires_grad, where
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same_value(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def _same_dict(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)  # same keys, same order
    for k in a:
        _same_value(a[k], b[k], k)


def _dcp_state(parts: list[nn.Module], optims: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What DCP's get_state_dict gives, merged over parts, fresh optimizers left fresh."""
    fresh = [not o.state for o in optims]
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for p, o in zip(parts, optims, strict=True):
        m, f = get_state_dict(p, o, options=OPTS)
        model.update(m)
        optim.update(f)
    for o, was in zip(optims, fresh, strict=True):
        if was:
            o.state.clear()
    return {"model": model, "optim": optim}


@pytest.mark.parametrize("steps", [2, 0], ids=["stepped", "fresh"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_plain_state_dicts_are_dcps(
    case: str, steps: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Same keys in the same order, same values bit for bit, same plain values; an optimizer
    that never stepped is left so."""
    debug_log = _debug(caplog)
    parts, optims, _ = CASES[case](1, steps)
    expected = _dcp_state(parts, optims)
    twin_parts, twin_optims, _ = CASES[case](1, steps)
    got = ModelAndOptim(twin_parts, twin_optims).state_dict_to_save()
    assert debug_log.text.count(PLAIN) == len(parts) and DCP not in debug_log.text
    _same_dict(got["model"], expected["model"])
    _same_dict(got["optim"], expected["optim"])
    assert [bool(o.state) for o in twin_optims] == [bool(o.state) for o in optims]


@pytest.mark.parametrize("case", list(CASES))
def test_the_plain_state_dicts_hold_the_live_objects_dcp_hands_out(case: str) -> None:
    """On one module: each model tensor views the same memory as DCP's, each optimizer
    value is the very object DCP returns (a load fills them in place)."""
    parts, optims, _ = CASES[case](2, 2)
    module = ModelAndOptim(parts, optims)
    expected = _dcp_state(parts, optims)
    got = module.state_dict_to_save()
    for k, v in got["model"].items():
        if isinstance(v, torch.Tensor):
            assert v.data_ptr() == expected["model"][k].data_ptr(), k
            assert v.storage_offset() == expected["model"][k].storage_offset(), k
    for k, v in got["optim"].items():
        assert v is expected["optim"][k], k
    state = module.state_dict_to_load(_Meta(got))
    _same_dict(state["model"], got["model"])
    unread = _unread_group_keys(parts, optims)
    _same_dict(state["optim"], {k: v for k, v in got["optim"].items() if k not in unread})


def _unread_group_keys(models: list[nn.Module], optims: list[torch.optim.Optimizer]) -> set[str]:
    """The flat `param_groups` keys a load does not read: those of each group's parameters
    after its first, but their first key (DCP looks for that one)."""
    names = {id(p): n for m in models for n, p in reversed(list(m.named_parameters()))}
    return {
        f"param_groups.{names[id(p)]}.{k}"
        for o in optims
        for g in o.param_groups
        for p in g["params"][1:]
        for k in [k for k in g if k != "params"][1:]
    }


def test_a_load_hands_out_only_the_group_values_it_reads(tmp_path: Path) -> None:
    """An optimizer's group values are most of its flat state (about ten per parameter), and
    a load reads only each group's first parameter's. The others are left out of the state
    to load, and the load still restores every group as the checkpoint has it."""
    parts, optims, _ = _two_groups(1, 2)
    for i, g in enumerate(optims[0].param_groups):
        g["lr"] = 0.5 + i
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", incremental=False).build()
    folder = ckpt.save(tmp_path / "step1", ModelAndOptim(parts, optims), {})
    target = _two_groups(7, 0)
    module = ModelAndOptim(*target[:2])
    saved = module.state_dict_to_save()
    handed = module.state_dict_to_load(_Meta(saved))
    unread = _unread_group_keys(target[0], target[1])
    assert unread and len(handed["optim"]) == len(saved["optim"]) - len(unread)
    ckpt.load(folder, module)
    ckpt.close()
    assert [g["lr"] for g in target[1][0].param_groups] == [0.5, 1.5]
    got, expected = _snapshot(target), _snapshot((parts, optims, []))
    assert got.keys() == expected.keys()
    for k in expected:
        _same_value(got[k], expected[k], k)


def _tied_second(seed: int, steps: int) -> Parts:
    """A tied parameter that is not its group's first (DCP looks for its first group key)."""
    torch.manual_seed(seed)
    m = Tied()
    o = torch.optim.AdamW([m.mid.weight, m.embed.weight, m.mid.bias], lr=1e-2)
    _train(list(m.parameters()), o, steps, seed)
    return [m], [o], []


@pytest.mark.parametrize("case", ["tied", "tied_second", "two_groups", "pipeline", "lr_scheduler"])
def test_the_state_handed_out_for_a_load_also_loads_through_dcp(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the plain load of the optimizer gives up after the state was handed out, DCP's
    `set_optimizer_state_dict` loads that state (without the group values loading does not
    read) into what the plain load gives."""
    debug_log = _debug(caplog)
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", incremental=False).build()
    make = CASES.get(case, _tied_second)
    folder = ckpt.save(tmp_path / "step1", ModelAndOptim(*make(1, 2)[:2]), {})
    plain = make(7, 3)
    ckpt.load(folder, ModelAndOptim(*plain[:2]))
    assert "loaded by DCP" not in debug_log.text
    monkeypatch.setattr(plain_state, "groups_to_load", lambda *a: "forced")
    debug_log.clear()
    through_dcp = make(7, 3)
    ckpt.load(folder, ModelAndOptim(*through_dcp[:2]))
    ckpt.close()
    assert "optimizer loaded by DCP: forced" in debug_log.text
    expected, got = _snapshot(plain), _snapshot(through_dcp)
    assert got.keys() == expected.keys()
    for k in expected:
        _same_value(got[k], expected[k], k)


@pytest.mark.parametrize("through_dcp", [False, True], ids=["plain", "dcp"])
def test_a_group_value_the_checkpoint_lacks_is_refused_by_name(
    tmp_path: Path, through_dcp: bool, force_dcp: Callable[[bool], None]
) -> None:
    """A key loading does not read is left out only when the checkpoint holds it: a group
    value saved for the first parameter of a group but not for another is refused by name,
    as DCP's strict load refuses it."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    # "foo" after "lr": a group's first key stays in for every parameter
    first = torch.optim.AdamW(
        [{"params": [model.weight], "lr": 0.1, "foo": 1}, {"params": [model.bias], "lr": 0.1}]
    )
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", incremental=False).build()
    folder = ckpt.save(tmp_path / "step1", ModelAndOptim(model, first), {})
    regrouped = torch.optim.AdamW([{"params": [model.weight, model.bias], "lr": 0.1, "foo": 1}])
    force_dcp(through_dcp)
    with pytest.raises(CheckpointError, match=r"optim\.param_groups\.bias\.foo"):
        ckpt.load(folder, ModelAndOptim(model, regrouped))
    ckpt.close()


class _Meta:
    """A metadata stand-in: `state_dict_to_load` only reads the saved keys."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state_dict_metadata = {f"{s}.{k}": None for s in state for k in state[s]}


def _snapshot(parts: Parts) -> dict[str, Any]:
    """Everything a load sets: model state (keep_vars), extra states, and each optimizer's
    state in parameter order and param_groups as they are (no state_dict() copy)."""
    models, optims, _ = parts
    snap: dict[str, Any] = {}
    for i, m in enumerate(models):
        snap[f"model{i}"] = dict(m.state_dict(keep_vars=True))
        for name, sub in m.named_modules():
            if isinstance(sub, Extra):
                snap[f"extra{i}.{name}"] = {"calls": sub.calls, "scale": sub.scale}
    for i, o in enumerate(optims):
        index = {id(p): j for j, p in enumerate(p for g in o.param_groups for p in g["params"])}
        snap[f"state{i}"] = {index[id(p)]: dict(s) for p, s in o.state.items()}
        snap[f"groups{i}"] = [
            {k: ([index[id(p)] for p in v] if k == "params" else v) for k, v in g.items()}
            for g in o.param_groups
        ]
        snap[f"type{i}"] = type(o.state).__name__
    return snap


@pytest.mark.parametrize("target_steps", [0, 3], ids=["into_fresh", "into_stepped"])
@pytest.mark.parametrize("case", list(CASES))
def test_save_and_load_give_what_dcp_gives(
    case: str,
    target_steps: int,
    tmp_path: Path,
    force_dcp: Callable[[bool], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A checkpoint saved by the plain walk loads by it into exactly what the DCP path gives
    (saved and loaded by DCP), both equal to the saved module; either checkpoint loads by
    either path alike."""
    debug_log = _debug(caplog)
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", incremental=False).build()
    if case == "frozen_and_gradless" and not target_steps:
        # a fresh optimizer's first step gives m[1].bias state the checkpoint lacks: both
        # paths refuse the load alike, naming the key
        source = CASES[case](1, 2)
        folder = ckpt.save(tmp_path / "p" / "step1", ModelAndOptim(*source[:2]), {"step": 1})
        for how in (False, True):
            force_dcp(how)
            target = CASES[case](7, 0)
            with pytest.raises(CheckpointError, match=r"optim\.state\.1\.bias"):
                ckpt.load(folder, ModelAndOptim(*target[:2]))
        ckpt.close()
        return
    source = CASES[case](1, 2)
    saved = _snapshot(source)
    plain_dir = ckpt.save(tmp_path / "plain" / "step1", ModelAndOptim(*source[:2]), {"step": 1})
    force_dcp(True)
    dcp_dir = ckpt.save(tmp_path / "dcp" / "step1", ModelAndOptim(*source[:2]), {"step": 1})
    results = {}
    for folder, how in [
        (plain_dir, "plain"),
        (dcp_dir, "dcp"),
        (plain_dir, "dcp"),
        (dcp_dir, "plain"),
    ]:
        force_dcp(how == "dcp")
        debug_log.clear()
        target = CASES[case](7, target_steps)
        assert ckpt.load(folder, ModelAndOptim(*target[:2])) == {"step": 1}
        assert (PLAIN in debug_log.text) == (how == "plain")
        assert ("loaded by DCP" in debug_log.text) is False
        results[(folder, how)] = _snapshot(target)
    ckpt.close()
    reference = results[(dcp_dir, "dcp")]
    for key, snap in results.items():
        assert snap.keys() == reference.keys(), key
        for k in snap:
            _same_value(snap[k], reference[k], f"{key}: {k}")
    # and the load restored the source (step counts, moments, lr, buffers, extra state); a
    # parameter without state gets an empty one from DCP's load (its Adam step starts afresh)
    for k in saved:
        got = reference[k]
        if k.startswith("state"):
            got = {i: s for i, s in got.items() if s}
        _same_value(got, saved[k], k)


def test_a_load_into_a_fresh_optimizer_still_takes_the_plain_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The resume case: the fresh optimizer gets its state initialised as DCP does, so the
    plain path applies, and its step counters and moments are the saved ones."""
    debug_log = _debug(caplog)
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", incremental=False).build()
    source = _mlp(1, 4)
    folder = ckpt.save(tmp_path / "step4", ModelAndOptim(*source[:2]), {})
    target = _mlp(9, 0)
    debug_log.clear()
    ckpt.load(folder, ModelAndOptim(*target[:2]))
    ckpt.close()
    assert PLAIN in debug_log.text and "DCP" not in debug_log.text
    for p in target[1][0].param_groups[0]["params"]:
        assert target[1][0].state[p]["step"].item() == 4.0


def _with_dcp_reason(module: ModelAndOptim, caplog: pytest.LogCaptureFixture, why: str) -> None:
    caplog.clear()
    module.state_dict_to_save()
    assert DCP in caplog.text and PLAIN not in caplog.text, caplog.text
    assert why in caplog.text


class OwnLoad(nn.Linear):
    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)


class OwnStateDict(nn.Linear):
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return super().state_dict(*args, **kwargs)


class GetOnly(nn.Linear):
    def get_extra_state(self) -> Any:
        return 1


class OwnOptimStateDict(torch.optim.AdamW):
    def state_dict(self) -> Any:
        return super().state_dict()


def _module(inner: nn.Module | None = None) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), inner if inner is not None else nn.Linear(4, 4))


def _stepped(model: nn.Module, cls: type = torch.optim.AdamW) -> ModelAndOptim:
    o = cls(model.parameters(), lr=1e-2)
    _train(list(model.parameters()), o, 1, 0)
    return ModelAndOptim(model, o)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: _stepped(torch.compile(_module())), "OptimizedModule"),
        (lambda: _stepped(_ckpt_wrapped()), "CheckpointWrapper"),
        (lambda: _stepped(_module(nn.BatchNorm1d(4))), "overrides _load_from_state_dict"),
        (lambda: _stepped(_module(OwnLoad(4, 4))), "overrides _load_from_state_dict"),
        (lambda: _stepped(_module(OwnStateDict(4, 4))), "overrides state_dict"),
        (lambda: _stepped(_module(GetOnly(4, 4))), "only one of get_extra_state"),
        (lambda: _stepped(_hooked("register_state_dict_pre_hook")), "state_dict_pre_hooks"),
        (lambda: _stepped(_hooked("register_state_dict_post_hook")), "state_dict_hooks"),
        (lambda: _stepped(_hooked("register_load_state_dict_pre_hook")), "load_state_dict_pre"),
        (lambda: _stepped(_hooked("register_load_state_dict_post_hook")), "load_state_dict_post"),
        (lambda: _stepped(_module(), OwnOptimStateDict), "OwnOptimStateDict overrides state_dict"),
        (lambda: _optim_hooked("register_state_dict_pre_hook"), "state_dict_pre_hooks hook"),
        (lambda: _optim_hooked("register_load_state_dict_post_hook"), "load_state_dict_post"),
        (lambda: ModelAndOptim(_meta_module()), "meta device"),
        (lambda: _nested_state(), "state value of type dict"),
    ],
)
def test_what_the_walk_cannot_be_sure_of_goes_through_dcp(
    make: Callable[[], ModelAndOptim], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    debug_log = _debug(caplog)
    _with_dcp_reason(make(), debug_log, why)


def _ckpt_wrapped() -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return _module(checkpoint_wrapper(nn.Linear(4, 4)))


def _hooked(register: str) -> nn.Module:
    m = _module()
    hooks = {
        "register_state_dict_pre_hook": lambda *a: None,
        "register_state_dict_post_hook": lambda *a: None,
        "register_load_state_dict_pre_hook": lambda *a: None,
        "register_load_state_dict_post_hook": lambda *a: None,
    }
    getattr(m[1], register)(hooks[register])
    return m


def _optim_hooked(register: str) -> ModelAndOptim:
    module = _stepped(_module())
    assert module.optim is not None
    getattr(module.optim, register)(lambda *a: None)
    return module


def _meta_module() -> nn.Module:
    with torch.device("meta"):
        return _module()


def test_an_optimizer_of_parameters_outside_the_model_fails_as_dcp_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    debug_log = _debug(caplog)
    m = _module()
    stray = nn.Parameter(torch.ones(3))
    module = ModelAndOptim(m, torch.optim.SGD([*m.parameters(), stray], lr=0.1))
    with pytest.raises(KeyError):
        module.state_dict_to_save()
    assert "the optimizer holds a parameter that is not in the model" in debug_log.text


class Nested(torch.optim.SGD):
    """An optimizer with nested state (as Shampoo's), which DCP flattens its own way."""

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["inner"] = {"a": torch.zeros(1)}
        return out


def _nested_state() -> ModelAndOptim:
    return _stepped(_module(), Nested)


def test_a_load_state_dict_pre_hook_still_runs(tmp_path: Path) -> None:
    """The fallback is real: DCP's load calls `Module.load_state_dict`, and the hook sees it."""
    seen: list[str] = []
    source = _stepped(_module())
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", incremental=False).build()
    folder = ckpt.save(tmp_path / "s1", source, {})
    target = _module()
    target[1].register_load_state_dict_pre_hook(lambda m, sd, prefix, *a: seen.append(prefix))
    ckpt.load(folder, _stepped(target))
    ckpt.close()
    assert seen == ["1."]
    assert torch.equal(target[1].weight, source.model[1].weight)


def test_the_compiled_module_is_saved_under_its_plain_names(tmp_path: Path) -> None:
    source = _stepped(_module())
    compiled = ModelAndOptim(torch.compile(source.model), source.optim)
    state = compiled.state_dict_to_save()
    assert sorted(state["model"]) == sorted(source.state_dict_to_save()["model"])
    assert not any("_orig_mod" in k for k in state["optim"])


def test_a_value_loaded_into_a_new_object_is_copied_by_dcp(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loader that replaces a tensor instead of filling it in place: DCP copies it in."""
    debug_log = _debug(caplog)
    parts, optims, _ = _mlp(1, 2)
    module = ModelAndOptim(parts, optims)
    state = module.state_dict_to_load(_Meta(module.state_dict_to_save()))
    state["model"]["0.bias"] = torch.full((8,), 3.0)
    module.load_state_dict(state)
    assert torch.equal(parts[0][0].bias, torch.full((8,), 3.0))
    assert "'0.bias' was loaded into a new object" in debug_log.text


def test_a_dict_not_handed_out_goes_through_dcp() -> None:
    parts, optims, _ = _mlp(1, 2)
    module = ModelAndOptim(parts, optims)
    state = module.state_dict_to_save()
    other = {
        "model": {k: v.clone() + 1 for k, v in state["model"].items()},
        "optim": state["optim"],
    }
    module.load_state_dict(other)
    assert torch.equal(parts[0][0].bias, other["model"]["0.bias"])
    assert module._handed_out is None


def test_a_key_the_loader_dropped_fails_as_dcp_fails() -> None:
    parts, optims, _ = _mlp(1, 2)
    module = ModelAndOptim(parts, optims)
    state = module.state_dict_to_load(_Meta(module.state_dict_to_save()))
    assert isinstance(module._handed_out, _HandedOut)
    del state["model"]["0.bias"]
    with pytest.raises(KeyError, match="0.bias"):
        module.load_state_dict(state)


def _two_group_adam() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = [
        nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16)),
        nn.Parameter(torch.randn(5)),
        nn.Parameter(torch.randint(0, 5, (3,)), requires_grad=False),
    ]
    return torch.optim.AdamW(
        [{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.2}], betas=(0.8, 0.9)
    )


@pytest.mark.parametrize("odd", [None, "a string state value"])
def test_load_optim_gives_what_the_optimizers_own_load_gives(odd: str | None) -> None:
    """The same casts (float state to a bf16 parameter's dtype, the step left alone, an int
    parameter's state kept), the same objects where no cast is needed, the same groups with
    a value shared by two groups still shared; a value that is no tensor or number goes
    through the optimizer's own load, whole."""
    shared = [0.5, 0.25]  # a mutable hyperparameter held by both groups
    state = {
        0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 3), "exp_avg_sq": torch.ones(4, 3)},
        1: {"step": torch.tensor(3.0), "exp_avg": torch.ones(5), "exp_avg_sq": torch.ones(5)},
        2: {"step": torch.tensor(1.0), "exp_avg": torch.tensor([1, 2, 3])},
    }
    if odd is not None:
        state[1]["note"] = odd
    groups = [
        {"params": [0, 1], "lr": 0.01, "betas": (0.8, 0.9), "extra": shared},
        {"params": [2], "lr": 0.02, "betas": (0.8, 0.9), "extra": shared},
    ]
    mine, theirs = _two_group_adam(), _two_group_adam()
    plain_state.load_optim(mine, state, groups)
    theirs.load_state_dict({"state": state, "param_groups": groups})
    for a, b in zip(mine.param_groups, theirs.param_groups, strict=True):
        assert a.keys() == b.keys() and a["lr"] == b["lr"] and a["extra"] == b["extra"]
    assert mine.param_groups[0]["extra"] is mine.param_groups[1]["extra"]
    assert mine.param_groups[0]["extra"] is not shared
    mp = [p for g in mine.param_groups for p in g["params"]]
    tp = [p for g in theirs.param_groups for p in g["params"]]
    for i, (p, q) in enumerate(zip(mp, tp, strict=True)):
        got, want = mine.state[p], theirs.state[q]
        assert got.keys() == want.keys()
        for key in got:
            if isinstance(want[key], torch.Tensor):
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key])
                assert (got[key] is state[i][key]) == (want[key] is state[i][key]), (i, key)
            else:
                assert got[key] == want[key]
    assert mine.state[mp[0]]["exp_avg"].dtype == torch.bfloat16
    assert mine.state[mp[1]]["exp_avg"] is state[1]["exp_avg"]
