"""The deepmd-kit seam, in process: schema registration, version check, trainer patch."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
import warnings

import deepmd.backend  # noqa: F401  (loads our "deepmd.backend" entry point, as `dp` does)
import pytest

from deepmd_hybridmuon import HybridMuonOptimizer, plugin
from deepmd_hybridmuon.schema import hybrid_muon_arguments


def _registry():
    from deepmd.utils import argcheck

    return argcheck.opt_args_plugin._ArgsPlugin__plugin.plugins


def test_entry_point_replaced_the_builtin_schema_once():
    keys = [key for key in _registry() if key[0] == "HybridMuon"]
    assert len(keys) == 1
    assert _registry()[keys[0]] is hybrid_muon_arguments
    plugin.register_schema()  # idempotent: still one entry, still ours
    assert [key for key in _registry() if key[0] == "HybridMuon"] == keys
    # the variant order of deepmd's optimizer types is kept
    assert [key[0] for key in _registry()] == ["Adam", "AdamW", "LKF", "AdaMuon", "HybridMuon"]


def test_schema_keeps_every_builtin_key_and_default():
    from deepmd.utils.argcheck import normalize

    from deepmd_hybridmuon.validation import LEGACY_KEYS, REMOVED_KEYS

    ours = {a.name: a for a in hybrid_muon_arguments()}
    expected_defaults = {
        "momentum": 0.95,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "weight_decay": 0.001,
        "lr_adjust": 0.0,
        "lr_adjust_coeff": 0.18,
        "muon_mode": "slice",
        "enable_gram": True,
        "flash_muon": True,
        "magma_muon": True,
    }
    assert {k: ours[k].default for k in expected_defaults} == expected_defaults
    assert set(ours) == set(expected_defaults) | set(LEGACY_KEYS) | set(REMOVED_KEYS)
    # The optimizer's constructor, used outside dp, has the same defaults as the schema.
    signature = inspect.signature(HybridMuonOptimizer).parameters
    constructor = {k: signature[k].default for k in expected_defaults if k in signature}
    constructor |= dict(zip(("adam_beta1", "adam_beta2"), signature["adam_betas"].default, strict=True))
    assert constructor == expected_defaults
    assert list(ours["momentum"].alias) == ["muon_momentum"]
    # the alias still normalises through deepmd's own normalize()
    data = _minimal_input({"type": "HybridMuon", "muon_momentum": 0.9})
    assert normalize(data)["optimizer"]["momentum"] == 0.9


@pytest.mark.parametrize("value", ["auto", "off", None])
def test_the_schema_refuses_the_removed_ddp_split_by_name(value):
    """dp train's own normalize() (dp check's too) says the key was removed and what to do; an input
    without it gets no ``ddp_split`` filled in."""
    from dargs.dargs import ArgumentValueError
    from deepmd.utils.argcheck import normalize

    from deepmd_hybridmuon.validation import REMOVED_KEYS

    with pytest.raises(ArgumentValueError, match="key `ddp_split` gets bad value") as err:
        normalize(_minimal_input({"type": "HybridMuon", "ddp_split": value}))
    assert str(err.value).endswith(REMOVED_KEYS["ddp_split"])
    assert "ddp_split" not in normalize(_minimal_input({"type": "HybridMuon"}))["optimizer"]


def test_the_json_schema_of_the_input_has_the_removed_key():
    """deepmd's JSON schema of the input (for editors) takes the removed key's types (dargs needs JSON types)."""
    from deepmd.utils.argcheck import gen_json_schema

    plugin.register_schema()
    assert '"ddp_split": {"description": "ddp_split was removed' in gen_json_schema()


def _minimal_input(optimizer):
    return {
        "model": {
            "type_map": ["A", "B"],
            "descriptor": {"type": "se_e2_a", "sel": [8, 8], "rcut": 3.0, "rcut_smth": 0.5, "neuron": [4, 8]},
            "fitting_net": {"neuron": [8]},
        },
        "learning_rate": {"type": "exp", "start_lr": 1e-3, "stop_lr": 1e-5, "decay_steps": 10},
        "loss": {"type": "ener"},
        "optimizer": optimizer,
        "training": {"training_data": {"systems": ["x"]}, "numb_steps": 1},
    }


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("muon_mode", "3d", "expected one of '2d', 'flat', 'slice'"),
        ("momentum", 1.0, r"expected a number in \[0, 1\)"),
        ("adam_beta2", -0.1, r"expected a number in \[0, 1\)"),
        ("weight_decay", -1.0, r"expected a number in \[0, 1e\+08\]"),
        ("lr_adjust", float("nan"), "expected a finite number"),
        ("enable_gram", "yes", "requires <bool>"),
    ],
)
def test_schema_rejects_bad_values(key, value, fragment):
    from dargs.dargs import ArgumentError
    from deepmd.utils.argcheck import normalize

    with pytest.raises(ArgumentError, match=rf"optimizer.*`{key}`.*{fragment}"):
        normalize(_minimal_input({"type": "HybridMuon", key: value}))


def test_doc_train_input_shows_our_muon_mode_choices():
    out = subprocess.run(
        [sys.executable, "-m", "deepmd", "doc-train-input"], capture_output=True, text=True, check=True
    ).stdout
    assert "Choices: '2d' | 'flat' | 'slice'" in out
    assert "deepmd-hybridmuon" in out


@pytest.mark.parametrize("installed", ["3.1.1", "3.3.0", "4.0.0", "2.2.10"])
def test_unsupported_deepmd_version_fails_with_the_supported_range(installed):
    with pytest.raises(plugin.UnsupportedDeepmdError, match=rf"supports deepmd-kit >=3\.2\.0,<3\.3.*{installed}"):
        plugin.check_deepmd_version(installed)


@pytest.mark.parametrize("installed", ["3.2.0", "3.2.1", "3.2.0rc1", "3.2.5.dev3"])
def test_supported_deepmd_versions(installed):
    assert plugin.check_deepmd_version(installed) == installed


def test_trainer_without_the_seam_is_refused():
    old = types.ModuleType("deepmd.pt.train.training_old")

    class Trainer:  # a trainer of another deepmd-kit release: no _create_optimizer
        pass

    old.Trainer = Trainer
    old.HybridMuonOptimizer = object
    with pytest.raises(plugin.UnsupportedDeepmdError, match=r"_create_optimizer.*supported: deepmd-kit >=3\.2\.0"):
        plugin.patch_trainer(old)


@pytest.mark.parametrize("module_name", plugin.TRAINER_MODULES)
def test_real_trainers_are_patched_on_import(module_name):
    import importlib

    module = importlib.import_module(module_name)
    assert module.Trainer._hybridmuon_patched is True
    create = module.Trainer._create_optimizer
    assert create.__wrapped__ is not create  # our wrapper around deepmd's method
    plugin.patch_trainer(module)  # idempotent
    assert module.Trainer._create_optimizer is create


def test_optimizer_kwargs_maps_legacy_keys_and_keeps_trainer_keywords():
    trainer_kwargs = {"lr": 1e-3, "muon_mode": "slice", "enable_gram": True}
    section = {"type": "HybridMuon", "muon_mode": "slice", "muon_2d_only": True, "min_2d_dim": 4}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwargs = plugin.optimizer_kwargs(section, trainer_kwargs)
    assert kwargs["muon_mode"] == "2d"
    assert kwargs["lr"] == 1e-3 and kwargs["enable_gram"] is True
    texts = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("muon_2d_only" in t and "'2d'" in t for t in texts)
    assert any("min_2d_dim" in t and "ignored" in t for t in texts)
    # keys of the section that our constructor does not take are not passed on
    assert "type" not in kwargs and "min_2d_dim" not in kwargs and "muon_2d_only" not in kwargs


def test_routing_summary_counts_routes():
    import torch

    named = [
        ("fit.layers.0.matrix", torch.nn.Parameter(torch.zeros(8, 4))),
        ("fit.layers.0.bias", torch.nn.Parameter(torch.zeros(4))),
        ("desc.adamw_scale", torch.nn.Parameter(torch.zeros(3, 3))),
    ]
    opt = HybridMuonOptimizer([p for _, p in named], named_parameters=named)
    assert plugin.routing_summary(opt) == (
        "muon 1 tensors / 32 elements, adam 1 tensors / 4 elements, adamw 1 tensors / 9 elements"
    )


@pytest.mark.parametrize(("value", "off"), [("1", True), ("yes", True), ("false", False), (" Off ", False)])
def test_the_disable_switch_keeps_the_builtin_for_values_that_say_off(tmp_path, value, off):
    code = (
        "import deepmd.backend, deepmd.pt.train.training as t\n"
        "from deepmd.utils import argcheck\n"
        "reg = argcheck.opt_args_plugin._ArgsPlugin__plugin.plugins\n"
        f"assert getattr(t.Trainer, '_hybridmuon_patched', False) == {not off}\n"
        f"assert all(f.__module__.startswith('deepmd.') for f in reg.values()) == {off}\n"
    )
    env = {**__import__("os").environ, plugin.DISABLE_ENV: value}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)


def test_restart_with_a_routing_that_no_longer_fits_the_state_is_refused():
    """The input's muon_mode wins over the checkpoint's; state built for another routing is caught."""
    import torch

    named = [
        ("blk.w3", torch.nn.Parameter(torch.randn(3, 4, 5))),
        ("fit.matrix", torch.nn.Parameter(torch.randn(6, 4))),
    ]
    params = [p for _, p in named]
    old = HybridMuonOptimizer(params, muon_mode="slice", named_parameters=named)
    for p in params:
        p.grad = torch.randn_like(p)
    old.step()
    new = HybridMuonOptimizer(params, muon_mode="2d", named_parameters=named)
    wanted = [{k: g[k] for k in ("muon_mode",)} for g in new.param_groups]
    new.load_state_dict(old.state_dict())
    assert new.param_groups[0]["muon_mode"] == "slice"  # torch restores the checkpoint's groups
    plugin._input_wins(new, wanted)
    assert new.param_groups[0]["muon_mode"] == "2d"
    problems = new.state_routing_mismatches()
    assert problems == ["blk.w3: Muon state, but routed to adamw"]


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_stage_1_makes_ranks_agree_on_skipping(stage, tmp_path):
    """deepmd's real ``_create_optimizer`` (our wrapper around it) on a trainer built only as far
    as that method needs: ZeRO-1 gets ``nonfinite_across_ranks``, a plain optimizer does not."""
    import torch
    import torch.distributed as dist
    from deepmd.pt.train import training
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        trainer = training.Trainer.__new__(training.Trainer)  # no model, data or config
        trainer.sharding = types.SimpleNamespace(stage=stage)
        trainer.wrapper = torch.nn.Linear(8, 4)
        trainer._hybridmuon_section = {}
        opt = trainer._create_optimizer(training.HybridMuonOptimizer, lr=1e-3)
        local = opt.optim if stage == 1 else opt
        assert isinstance(opt, ZeroRedundancyOptimizer) == (stage == 1)
        assert isinstance(local, HybridMuonOptimizer)
        assert local.nonfinite_across_ranks == (stage == 1)
        for p in trainer.wrapper.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # the all-reduce of the flag runs (one rank)
        assert all(torch.isfinite(p).all() for p in trainer.wrapper.parameters())
    finally:
        dist.destroy_process_group()
