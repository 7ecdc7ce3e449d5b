"""Data parallelism on two CPU processes (gloo): DDP, ZeRO-1 and FSDP2, each against one process.

deepmd-kit 3.2.0's trainer cannot run distributed on the CPU (``dp`` initialises
``cuda:nccl,cpu:gloo`` and calls ``torch.cuda.set_device``), so these tests drive the
optimizer on real tiny deepmd models directly. One pair of processes is spawned for the
whole module (starting Python, torch and deepmd twice costs more than the scenarios): each
scenario writes its results to a temporary folder, and the tests here compare them with
single-process runs made in the pytest process. A child that raises stops the pair; its
traceback is the failure message of every test whose scenario did not finish.

Scenarios
---------
* DDP: ``DistributedDataParallel`` over the se_e2_a model, each rank a different frame
  (real forward and backward, gradients averaged by DDP); the optimizer on every rank does
  what one process does with the averaged gradient. deepmd's real ``_create_optimizer`` (our
  wrapper) on two ranks: a plain optimizer at ``zero_stage`` 0, ``nonfinite_across_ranks`` for
  ZeRO-1's local optimizer.
* ZeRO-1: ``ZeroRedundancyOptimizer(optimizer_class=HybridMuonOptimizer)`` with names set as
  deepmd's trainer does; its consolidated state dict resumes a single-process optimizer.
  A NaN gradient skips the step on every rank with ``nonfinite_across_ranks`` (what the
  plugin sets for ``zero_stage`` 1); without it only the owning rank's partition skips.
* FSDP2: ``fully_shard`` over a float32 DPA-2 model plus extra parameters (uneven first
  dimensions, an empty shard, a 3-D slice-mode tensor, rank-deficient gradients, AdamW);
  default options (Gram path and Magma on); a step with a NaN in one rank's shard only;
  full optimizer state dict out and in (``torch.distributed.checkpoint.state_dict``), and a
  single-process checkpoint loaded with plain ``load_state_dict``.
"""

from __future__ import annotations

import ast
import copy
import math
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import (
    KERNEL_MUON_TOL,
    RETRY_WARNING,
    build_model,
    make_optimizer,
    seeded_grads,
    set_grads,
    use_implementation,
)

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon import functional as F

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)

WORLD = 2
LR = 1e-3
#: FSDP2 / ZeRO-1: steps before the checkpoint, then steps after it.
STEPS_BEFORE, STEPS_AFTER = 3, 2
#: FSDP2: the step whose gradient holds a NaN, on rank 1's shard of ``extra.lowrank`` only.
NAN_STEP = 1
DDP_STEPS = 3
#: FSDP2: options of the second sharded run (all but the defaults).
OTHER_OPTIONS = {"magma_muon": False, "enable_gram": False, "muon_mode": "flat", "lr_adjust": 2.0, "weight_decay": 0.01}
#: FSDP2: largest Muon gradient element of the huge-gradient steps (float32's largest number last).
HUGE_SCALES = (1e20, 1e30, float(torch.finfo(torch.float32).max))
#: FSDP2, the same in half precision (bfloat16 has float32's range; float16's largest is its only huge number).
HUGE_HALF = ((torch.bfloat16, 1e20), (torch.bfloat16, 1e30), (torch.float16, float(torch.finfo(torch.float16).max)))
#: Seconds the pair of processes may take before the tests give up on it.
SPAWN_TIMEOUT = 240

# Tolerances: relative norm of the difference of the accumulated changes p_T - p_0 (see
# _rel_diff), per parameter, worst parameter.
#
# Same optimizer code on the same full tensors in one process and in two: bitwise equal,
# measured 0.0 everywhere (DDP; ZeRO-1 with the per-parameter loop). Asserted exactly.
# FSDP2 (deepmd_hybridmuon.distributed): elementwise rules on the shards and Newton–Schulz on
# the owner's whole matrices, stacked by shape, are the loop's arithmetic (asserted exactly
# without Magma); with Magma, the cosines come from per-shard sums added across ranks, another
# order of float32 summation: Muon tensors within OWNER_RTOL_MUON, Adam tensors exact.
#
#: The flat engine (one process, the default implementation) against the loop (and each ZeRO-1 rank's
#: engine on its partition): Magma's sums and the float16
#: Gram form change roundings (test_parity_builtin.ENGINE_VS_LOOP_RTOL, 2^-7 = 7.8e-3).
#: Measured here after 5 steps, worst parameter, when the CPU still ran the float16 Gram form: FSDP2 vs
#: one-process engine 4.3e-3 (``extra.slab``, Gram path; Adam routes 0.0); ZeRO-1 engines vs one-process
#: engine 7.6e-4 (one matrix; every other parameter bitwise equal).
ENGINE_RTOL_MUON = 2.0**-7
ENGINE_RTOL_ADAM = 1e-6
#: FSDP2 (the owner computes) against the single-process loop (muon tensors). The owner runs the loop's
#: arithmetic on the same whole matrices, stacked by shape across parameters; Magma's
#: cosines come from per-shard partial sums added across ranks (float32, another order of
#: summation), whose rounding can move a bfloat16/float16 rounding of the Newton–Schulz
#: result: bounded by the engine tolerance (2^-7, the bfloat16 unit roundoff). Adam-routed
#: tensors are elementwise and must match bitwise.
#: Whether the owners' Newton–Schulz runs the engine's Triton launches in these runs: under
#: Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) it does.
OWNERS_KERNELS = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"
#: With the Triton launches the owners' products are rounded in the kernels' order, not
#: cuBLAS's/the loop's: conftest.KERNEL_MUON_TOL (3e-2; the kernels against the loop,
#: measured <= 1.6 %). Measured here under the interpreter (whose standard iteration runs in
#: float16, conftest.kernels): 9.8e-3 after 3 steps, worst parameter.
OWNER_RTOL_MUON = KERNEL_MUON_TOL if OWNERS_KERNELS == "triton" else ENGINE_RTOL_MUON


# ----------------------------------------------------------------------------- models and data


class _Net(torch.nn.Module):
    """A float32 DPA-2 model plus parameters that exercise sharding corner cases.

    Under a 2-rank ``fully_shard``: ``extra.slab`` (3, 5, 6) is three matrices split 2 + 1;
    ``extra.lowrank`` (7, 10) and the model's (9, 4) matrix split 4 + 3 rows; ``extra.pair``
    (2, 4) one row each; the model's (1, 4) embedding leaves rank 1 an empty shard;
    ``extra.adamw_gain`` is AdamW (decayed) by name; the size-0 ``compress_*`` placeholders
    are frozen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model("dpa2", "float32")
        gen = torch.Generator().manual_seed(7)
        shapes = {"slab": (3, 5, 6), "lowrank": (7, 10), "square_lowrank": (6, 6), "pair": (2, 4), "adamw_gain": (3, 4)}
        self.extra = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for k, s in shapes.items()}
        )
        # The size-0 ``compress_*`` placeholders get no gradient in training, hence no optimizer
        # state (with any optimizer, torch's Adam too), and set_optimizer_state_dict's default
        # strict check rejects a trainable parameter without state: freeze them.
        for p in self.parameters():
            if p.numel() == 0:
                p.requires_grad_(False)


def _full_grads(named: list[tuple[str, torch.Tensor]], step: int, nan: bool = False) -> list[torch.Tensor]:
    """Gradients of step ``step`` (same on every rank and in one process), some rank-deficient."""
    grads = seeded_grads([p for _, p in named], step)
    out = []
    for (name, _), g in zip(named, grads, strict=True):
        if name.endswith("lowrank"):  # rank 1
            g = torch.outer(g[:, 0], g[0, :])
        elif name.endswith("linear1.matrix"):  # (24, 8), rank 2
            g = g[:, :2] @ g[:2, :]
        elif name == "extra.slab":  # a full-rank, a rank-1 and a zero matrix
            g = torch.stack([g[0], torch.outer(g[1][:, 0], g[1][0, :]), torch.zeros_like(g[2])])
        if nan and name == "extra.lowrank":
            g = g.clone()
            g[-1, 0] = float("nan")  # row 6: rank 1's shard (rows 4..6) only
        out.append(g.contiguous())
    return out


def _frame(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 6-atom water-like frame (coordinates, types, box) for DDP's forward pass."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    coord = torch.rand(1, 6, 3, generator=gen, dtype=torch.float64) * 4.0
    atype = torch.tensor([[0, 0, 1, 1, 1, 1]])
    box = (torch.eye(3, dtype=torch.float64) * 4.0).reshape(1, 9)
    return coord, atype, box


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    coord, atype, box = _frame(rank, step)
    out = model(coord, atype, box=box)
    return out["energy"].sum() + 0.1 * out["force"].square().sum()


def _snapshot(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in named}


def _state_by_name(opt: HybridMuonOptimizer, named: list[tuple[str, torch.Tensor]]) -> dict[str, dict]:
    return {
        n: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
        for n, p in named
        if opt.state.get(p)
    }


# ----------------------------------------------------------------------------- child processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _save(outdir: str, name: str, rank: int, obj: dict) -> None:
    path = Path(outdir) / f"{name}.rank{rank}.pt"
    torch.save(obj, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)  # complete files only


def _scenario_ddp(rank: int, outdir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model("se_e2_a")  # float64
    named = list(model.named_parameters())
    # deepmd's trainer wraps with find_unused_parameters=True (the size-0 placeholders get no grad).
    ddp = DDP(model, find_unused_parameters=True)
    opt = HybridMuonOptimizer([p for _, p in named], named_parameters=named, lr=LR)
    for k in range(DDP_STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(ddp, rank, k).backward()
        opt.step()
    _save(outdir, "ddp", rank, {"params": _snapshot(named), "plugin_flags": _plugin_flags()})


def _plugin_flags() -> dict[int, tuple[type, bool]]:
    """The optimizer deepmd's real ``_create_optimizer`` (our wrapper) builds, per zero_stage: its
    (local optimizer's) type, ``nonfinite_across_ranks`` and (ZeRO-1) whether the parameters are bucket views.

    The trainer is built only as far as that method needs (as in test_plugin.py).
    """
    import types

    import deepmd.backend  # noqa: F401  (loads our "deepmd.backend" entry point, as `dp` does)
    from deepmd.pt.train import training

    out = {}
    for stage in (0, 1):
        trainer = training.Trainer.__new__(training.Trainer)
        trainer.sharding = types.SimpleNamespace(stage=stage)
        trainer.wrapper = torch.nn.Linear(8, 4)
        trainer._hybridmuon_section = {}
        opt = trainer._create_optimizer(training.HybridMuonOptimizer, lr=1e-3)
        local = opt.optim if stage == 1 else opt
        out[stage] = (type(local), local.nonfinite_across_ranks, getattr(opt, "parameters_as_bucket_view", None))
    return out


def _scenario_zero(rank: int, outdir: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    results: dict[str, object] = {}
    # deepmd's trainer also passes the constructor options flash_muon and use_foreach;
    # ZeroRedundancyOptimizer copies every keyword into its param_groups.
    try:
        ZeroRedundancyOptimizer(
            list(_Net().parameters()), optimizer_class=HybridMuonOptimizer, lr=LR, flash_muon=True, use_foreach=None
        )
        results["trainer_kwargs_error"] = None
    except ValueError as exc:
        results["trainer_kwargs_error"] = str(exc)

    # A NaN in one rank's partition only (rank-identical gradients: as after DDP's allreduce).
    net = _Net()
    named = list(net.named_parameters())
    # Without nonfinite_across_ranks only the owning rank skips; with it (what the plugin
    # sets for zero_stage 1) every rank does, in the loop and in the flat engine.
    for key, implementation, options in (
        ("moved_in_nan_step_local", "engine", {}),
        ("moved_in_nan_step", "engine", {"nonfinite_across_ranks": True}),
        ("moved_in_nan_step_loop", "loop", {"nonfinite_across_ranks": True}),
    ):
        net = _Net()
        named = list(net.named_parameters())
        zero = ZeroRedundancyOptimizer([p for _, p in named], optimizer_class=HybridMuonOptimizer, lr=LR, **options)
        use_implementation(zero.optim, implementation)
        zero.optim.set_param_names(named)
        set_grads([p for _, p in named], _full_grads(named, 0))
        zero.step()  # one finite step first: then the NaN step runs on state
        before = _snapshot(named)
        set_grads([p for _, p in named], _full_grads(named, 1, nan=True))
        zero.step()
        after = _snapshot(named)
        results[key] = [n for n in before if not torch.equal(before[n], after[n])]

    for label in ("loop", "engine"):
        net = _Net()
        named = list(net.named_parameters())
        params = [p for _, p in named]
        # parameters as views of one flat bucket per rank, as the plugin asks for zero_stage 1
        zero = ZeroRedundancyOptimizer(
            params, optimizer_class=HybridMuonOptimizer, lr=LR, parameters_as_bucket_view=True
        )
        use_implementation(zero.optim, label)
        zero.optim.set_param_names(named)  # as deepmd's trainer does
        for k in range(STEPS_BEFORE + STEPS_AFTER):
            if k == STEPS_BEFORE:
                results[f"{label}_mid"] = _snapshot(named)
                if label == "loop":
                    zero.consolidate_state_dict(to=0)
                    if rank == 0:
                        results["state_dict"] = zero.state_dict()
            set_grads(params, _full_grads(named, k))
            zero.step()
        results[f"{label}_end"] = _snapshot(named)
        results[f"{label}_owned"] = [n for n, p in named if p in zero.optim.state]
    # Two param_groups, a NaN in the first one's gradients only (test_zero1_nan_skips_only_its_group).
    net = _Net()
    named = list(net.named_parameters())
    zero = ZeroRedundancyOptimizer(
        _two_groups(net), optimizer_class=HybridMuonOptimizer, lr=LR, nonfinite_across_ranks=True
    )
    use_implementation(zero.optim, "loop")
    zero.optim.set_param_names(named)
    set_grads([p for _, p in named], _full_grads(named, NAN_STEP, nan=True))
    zero.step()
    results["two_groups_nan"] = _snapshot(named)
    results["restart_refused"] = _zero_restart_refused()
    _save(outdir, "zero", rank, results)


def _two_groups(net: _Net) -> list[dict]:
    """``net``'s parameters in two param_groups: the extra ones (``extra.lowrank``'s NaN), the model's."""
    return [{"params": list(net.extra.parameters())}, {"params": list(net.model.parameters()), "weight_decay": 0.0}]


def _zero_restart_refused() -> list[str]:
    """``dp --pt train --restart`` at ``zero_stage`` 1 (our wrapper of deepmd's ``_load_optimizer_state``).

    The checkpoint is what deepmd saves under ZeRO-1: ``ZeroRedundancyOptimizer.state_dict()``
    after one step, built with the keywords deepmd's trainer and the plugin pass (kept in ZeRO's
    param_groups). ZeroRedundancyOptimizer copies each state entry into the local optimizer itself,
    past its ``load_state_dict``: the checkpoint as written must load, and one with a group value
    the constructor refuses, or state of the wrong shape, must be refused before anything changes.
    So must deepmd-kit 3.1's (``muon_2d_only`` and ``min_2d_dim``, none of the later options), and the
    input's settings (here ``momentum``) must stay in effect through ZeRO's steps, which copy its own groups
    (the checkpoint's) into the local optimizer. Returns, per case, "loaded" (then the settings after a step)
    or the message and whether the local optimizer's state stayed empty.
    """
    import types

    import deepmd.backend  # noqa: F401  (loads our "deepmd.backend" entry point, as `dp` does)
    import torch.distributed as dist
    from deepmd.pt.train import training
    from torch.distributed.optim import ZeroRedundancyOptimizer

    named = list(_Net().named_parameters())
    kwargs = {"lr": LR, "flash_muon": True, "use_foreach": None, "nonfinite_across_ranks": True}

    def zero() -> ZeroRedundancyOptimizer:
        return ZeroRedundancyOptimizer([p for _, p in named], optimizer_class=HybridMuonOptimizer, **kwargs)

    writer = zero()
    set_grads([p for _, p in named], _full_grads(named, 0))
    writer.step()
    for target in range(dist.get_world_size()):  # every rank gets the whole checkpoint, as from a file
        writer.consolidate_state_dict(to=target)
        if target == dist.get_rank():
            written = writer.state_dict()
    bad_group = copy.deepcopy(written)
    bad_group["param_groups"][0]["momentum"] = 1.5
    bad_shape = copy.deepcopy(written)
    entry = next(e for e in bad_shape["state"].values() if "momentum_buffer" in e)
    entry["momentum_buffer"] = torch.zeros(3)
    legacy = copy.deepcopy(written)  # as deepmd-kit 3.1 wrote its groups
    for group in legacy["param_groups"]:
        for key in ("muon_mode", "enable_gram", "magma_muon", "flash_muon", "nonfinite_across_ranks"):
            group.pop(key, None)
        group.update(muon_2d_only=True, min_2d_dim=1)
    messages = []
    for checkpoint, momentum in ((written, 0.5), (bad_group, 0.95), (bad_shape, 0.95), (legacy, 0.5)):
        trainer = training.Trainer.__new__(training.Trainer)
        kwargs["momentum"] = momentum  # the input file's
        trainer.optimizer, trainer.restart_training = zero(), True
        trainer.sharding = types.SimpleNamespace(stage=1, shards_parameters=False)
        try:
            trainer._load_optimizer_state(copy.deepcopy(checkpoint))
        except ValueError as err:
            messages.append(f"{err} | state left empty: {len(trainer.optimizer.optim.state) == 0}")
            continue
        set_grads([p for _, p in named], _full_grads(named, 1))
        trainer.optimizer.step()
        groups = trainer.optimizer.optim.param_groups + trainer.optimizer.param_groups
        settings = sorted({(g["momentum"], g["muon_mode"]) for g in groups})
        messages.append(f"loaded | {settings}")
    return messages


def _shard_grads(named: list[tuple[str, torch.Tensor]], grads: list[torch.Tensor]) -> None:
    from torch.distributed.tensor import distribute_tensor

    for (_, p), g in zip(named, grads, strict=True):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if p.requires_grad else None


@torch.no_grad()
def _load_full(named: list[tuple[str, torch.Tensor]], full: dict[str, torch.Tensor]) -> None:
    from torch.distributed.tensor import distribute_tensor

    for n, p in named:
        p.to_local().copy_(distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=None).to_local())


def _full(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in named}


def _scenario_fsdp2(rank: int, outdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (WORLD,))

    def sharded_net(
        on=mesh, dtype=torch.float32, **options
    ) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]], HybridMuonOptimizer]:
        net = _Net().to(dtype)
        fully_shard(net, mesh=on)  # default options
        named = list(net.named_parameters())
        assert all(isinstance(p, DTensor) for _, p in named)
        opt = HybridMuonOptimizer([p for _, p in named], named_parameters=named, lr=LR, **options)
        return net, named, opt

    def step(named, opt, k):
        _shard_grads(named, _full_grads(named, k, nan=k == NAN_STEP))
        opt.step()

    results: dict[str, object] = {}
    net, named, opt = sharded_net()
    for k in range(STEPS_BEFORE):
        step(named, opt, k)
    results["mid"] = _full(named)
    results["local_shapes"] = {n: tuple(p.to_local().shape) for n, p in named}
    states = {n: opt.state[p] for n, p in named if opt.state.get(p)}
    results["state_kinds"] = {
        n: {k: (type(v).__name__, tuple(v.shape)) for k, v in st.items() if isinstance(v, torch.Tensor)}
        for n, st in states.items()
    }
    results["magma_scores"] = {n: st["magma_score"].clone() for n, st in states.items() if "magma_score" in st}

    options = StateDictOptions(full_state_dict=True)
    osd = get_optimizer_state_dict(net, opt, options=options)
    msd = get_model_state_dict(net, options=options)
    # (a copy: on rank 0 the optimizer loaded below keeps the plain tensors of ``osd``)
    results["full_osd_state"] = copy.deepcopy(osd["state"])

    # Resume: a fresh sharded model and optimizer from rank 0's full state dicts. (The
    # parameters are copied shard by shard: set_model_state_dict trips over deepmd's
    # ``_networks`` aliases of its ``networks`` parameters in ``state_dict()``.)
    net2, named2, opt2 = sharded_net()
    _load_full(named2, msd)
    bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(net2, opt2, osd if rank == 0 else {}, options=bcast)
    results["resumed_params"] = _full(named2)

    # A single-process checkpoint (written by the pytest process) loaded with plain
    # load_state_dict: the optimizer shards the full state tensors at its next step.
    ref = torch.load(Path(outdir) / "single_process_mid.pt", weights_only=False)
    _net3, named3, opt3 = sharded_net()
    _load_full(named3, ref["params"])
    results["loaded_params"] = _full(named3)
    opt3.load_state_dict(ref["state_dict"])

    for k in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        for nm, op in ((named, opt), (named2, opt2), (named3, opt3)):
            step(nm, op, k)
    results["end"] = _full(named)
    results["table"] = opt.execution_table()
    results["end_resumed"] = _full(named2)
    results["end_single_process_checkpoint"] = _full(named3)
    results["state_kinds_after_plain_load"] = {
        n: {k: type(v).__name__ for k, v in opt3.state[p].items() if isinstance(v, torch.Tensor)}
        for n, p in named3
        if opt3.state.get(p)
    }

    # Other options (no Magma: no partial sums; standard Newton–Schulz;
    # "flat" views across the sharded dimension), on a 2-D mesh: HSDP, (Replicate(), Shard(0)).
    hsdp = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard"))
    _net4, named4, opt4 = sharded_net(hsdp, **OTHER_OPTIONS)
    results["other_placements"] = str(named4[0][1].placements)
    from test_step import recording

    with recording() as runs:  # the phases each step asks for (test_fsdp2_runs_the_phases_in_the_one_order)
        for k in range(STEPS_BEFORE + STEPS_AFTER):
            step(named4, opt4, k)
    results["phases"] = runs
    results["other_end"] = _full(named4)

    # Gradients, and a loaded state dict's tensors, laid out otherwise than their parameters (Replicate() on
    # the Shard(0) mesh): redistributed like them (test_fsdp2_gradients_and_state_laid_out_otherwise).
    from torch.distributed.tensor import Replicate, distribute_tensor

    _net6, named6, opt6 = sharded_net()
    _net7, named7, opt7 = sharded_net()
    for k in range(STEPS_BEFORE):
        step(named6, opt6, k)
        for (_, p), g in zip(named7, _full_grads(named7, k, nan=k == NAN_STEP), strict=True):
            p.grad = distribute_tensor(g, p.device_mesh, [Replicate()], src_data_rank=None) if p.requires_grad else None
        opt7.step()
    results["replicated_grads_end"], results["sharded_grads_end"] = _full(named7), _full(named6)
    saved = opt6.state_dict()
    for st in saved["state"].values():
        for key, v in list(st.items()):
            if isinstance(v, DTensor):
                st[key] = v.redistribute(v.device_mesh, [Replicate()])
    _net8, named8, opt8 = sharded_net()
    _load_full(named8, _full(named6))
    opt8.load_state_dict(saved)
    for k in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        step(named6, opt6, k)
        step(named8, opt8, k)
    results["replicated_state_end"], results["sharded_state_end"] = _full(named8), _full(named6)

    # nonfinite_across_ranks: the optimizer's gate, agreed over all ranks, instead of the group's all-reduce
    # (test_fsdp2_with_the_gate_agreed_over_all_ranks).
    from deepmd_hybridmuon import distributed as D

    _net9, named9, opt9 = sharded_net(nonfinite_across_ranks=True)
    with D.trace_collectives() as trace9:
        for k in range(STEPS_BEFORE + STEPS_AFTER):
            step(named9, opt9, k)
    results["shared_gate_end"], results["shared_gate_trace"] = _full(named9), [kind for kind, _ in trace9]

    # Huge but finite Muon gradients, one step each from fresh state, and the same gradients
    # scaled down by a power of two (exact) to about 1; the Adam routes get the unscaled
    # gradient. See test_fsdp2_huge_finite_muon_gradients.
    huge = {}
    for dtype, scale in [(torch.float32, s) for s in HUGE_SCALES] + list(HUGE_HALF):
        for down in (1.0, 2.0 ** -math.floor(math.log2(scale))):
            _net5, named5, opt5 = sharded_net(dtype=dtype)
            huge[f"start {dtype}"] = _full(named5)
            grads = []
            for (name, p), g in zip(named5, _full_grads(named5, 0), strict=True):
                top = g.abs().amax() if g.numel() else torch.zeros(())
                grads.append(g / top * scale * down if _route(name, p.shape) == "muon" and top > 0 else g)
            _shard_grads(named5, [g.to(dtype) for g in grads])  # rounded after the power of two: bitwise alike
            opt5.step()
            key = f"{dtype} {scale}" if down == 1.0 else f"{dtype} {scale} scaled down"
            huge[key] = _full(named5)
            huge[f"state_finite_{key}"] = all(
                bool(torch.isfinite(v.to_local() if isinstance(v, DTensor) else v).all())
                for st in opt5.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor)
            )
    results["huge"] = huge
    dist.barrier()
    _save(outdir, "fsdp2", rank, results)


# ----------------------------------------------------------------------------- FSDP2: the owner computes

#: World sizes of the owner-computes scenario (2 in the pair above; 3 and 4 spawned apart).
OWNER_WORLDS = (2, 3, 4)
OWNER_STEPS = 3
#: The step whose gradient holds a NaN in ``w2d``'s last row: the last rank's shard only.
OWNER_NAN_STEP = 1
#: A synthetic model (no deepmd: its ranks start fast). Under 2, 3 and 4 ranks: ``w2d``
#: splits 4+3, 3+3+1, 2+2+2+1 rows (matrices cut across ranks); ``tiny`` has fewer rows
#: than 3 or 4 ranks (empty shards); ``square`` takes the standard Newton–Schulz path, the
#: others the Gram path; ``slab`` is five (4, 6) matrices in "slice" mode and one (20, 6)
#: matrix cut across ranks in "flat" mode; ``lead1`` is a (8, 5) matrix whose size-1 dim 0
#: puts it whole on rank 0 (every other shard empty); ``adamw_gain`` is AdamW by name,
#: ``bias`` Adam; ``nograd`` never gets a gradient.
OWNER_SHAPES: dict[str, tuple[int, ...]] = {
    "w2d": (7, 10),
    "tiny": (2, 4),
    "square": (6, 6),
    "slab": (5, 4, 6),
    "lead1": (1, 8, 5),
    "adamw_gain": (3, 4),
    "bias": (9,),
    "nograd": (6, 6),
}
#: Both with the defaults' Gram path and Magma.
OWNER_OPTIONS: dict[str, dict] = {"slice": {"muon_mode": "slice"}, "flat": {"muon_mode": "flat"}}
#: Model sizes (copies of the block) whose collective sequences are compared.
OWNER_COPIES = (1, 3)


class _Block(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for k, s in OWNER_SHAPES.items()}
        )


class _Synthetic(torch.nn.Module):
    def __init__(self, copies: int = 1) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(11 + c) for c in range(copies))


def _owner_grads(named: list[tuple[str, torch.Tensor]], step: int) -> list[torch.Tensor | None]:
    grads = seeded_grads([p for _, p in named], step)
    out: list[torch.Tensor | None] = []
    for (name, _), g in zip(named, grads, strict=True):
        if name.endswith("nograd"):
            out.append(None)
            continue
        if step == OWNER_NAN_STEP and name == "blocks.0.p.w2d":
            g = g.clone()
            g[-1, 3] = float("nan")
        out.append(g)
    return out


def _shard_owner_grads(named: list[tuple[str, torch.Tensor]], grads: list[torch.Tensor | None]) -> None:
    from torch.distributed.tensor import distribute_tensor

    for (_, p), g in zip(named, grads, strict=True):
        p.grad = None if g is None else distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)


def _scenario_owner(rank: int, outdir: str) -> None:
    """Owner-computes on ``world`` ranks: results, plans, transport and collective sequences."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from deepmd_hybridmuon import distributed as D

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def gathered(obj: object) -> list:
        out: list = [None] * world
        dist.all_gather_object(out, obj)
        return out

    results: dict[str, object] = {}
    for label, options in OWNER_OPTIONS.items():
        for copies in OWNER_COPIES:
            net = _Synthetic(copies)
            fully_shard(net, mesh=mesh)
            named = list(net.named_parameters())
            opt = HybridMuonOptimizer([p for _, p in named], named_parameters=named, lr=LR, **options)
            traces = []
            for k in range(OWNER_STEPS):
                _shard_owner_grads(named, _owner_grads(named, k))
                before = _full(named)
                with D.trace_collectives() as trace:
                    opt.step()
                traces.append(list(trace))
                if k == OWNER_NAN_STEP:
                    after = _full(named)
                    results[f"{label}/{copies}/moved_in_nan_step"] = [
                        n for n in before if not torch.equal(before[n], after[n])
                    ]
            runner = opt._runners[0]  # the group's FSDP2 runner: its plan and this rank's exchange
            plan, ex = runner.plan, runner.exchange
            key = f"{label}/{copies}"
            results[f"{key}/plans"] = gathered(repr(plan))
            results[f"{key}/traces"] = gathered(traces)
            results[f"{key}/owned"] = gathered(sorted(int(i) for g in ex.groups for i in g.matrix_ids))
            results[f"{key}/num_matrices"] = ex.num_matrices
            results[f"{key}/load"] = plan.load
            results[f"{key}/local_shapes"] = gathered({n: tuple(p.to_local().shape) for n, p in named})
            if copies == 1:
                results[f"{key}/end"] = _full(named)
                results[f"{key}/table"] = opt.execution_table()

            # Transport: random float64 stand-ins for the Muon updates go to the owners whole
            # and come back unchanged.
            params = opt.param_groups[0]["params"]
            muon = [params[layout.index] for layout in plan.muon]
            gen = torch.Generator().manual_seed(5)
            full = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in muon]
            local = torch.cat(
                [
                    f[layout.ranges[rank][0] : layout.ranges[rank][1]].reshape(-1)
                    for f, layout in zip(full, plan.muon, strict=True)
                ]
            )
            matrices = [m for f, layout in zip(full, plan.muon, strict=True) for m in f.reshape(layout.view[0], -1)]
            expected = torch.cat([matrices[int(i)] for g in ex.groups for i in g.matrix_ids] or [local[:0]])
            pg = mesh.get_group(0)
            with D.trace_collectives() as trace:
                owned = D.to_owners(ex, local, pg)
                back = D.from_owners(ex, owned, pg)
            results[f"{key}/transport_owned_exact"] = torch.equal(owned, expected)
            results[f"{key}/transport_back_exact"] = torch.equal(back, local)
            results[f"{key}/transport_trace"] = list(trace)
    _save(outdir, f"owner{world}", rank, results)


SCENARIOS = {
    "fsdp2": _scenario_fsdp2,
    "zero": _scenario_zero,
    "ddp": _scenario_ddp,
    "owner": _scenario_owner,
}


def _worker(rank: int, port: int, outdir: str, world: int, names: tuple[str, ...]) -> None:
    import faulthandler

    import torch.distributed as dist

    # Everything this rank prints on stderr (C++ "terminate called ..." included) and, on a
    # fatal signal, every thread's Python stack go to a file that _spawn quotes in its error.
    log = open(Path(outdir) / f"rank{rank}.log", "w")  # open until the process ends
    os.dup2(log.fileno(), 2)
    faulthandler.enable(log, all_threads=True)
    torch.set_num_threads(1)  # as the pytest process (conftest): same reduction order
    if OWNERS_KERNELS == "triton":  # under Triton's interpreter: its workarounds, as the kernels fixture's
        from conftest import interpreter_workarounds

        interpreter_workarounds()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        for name in names:
            start = time.perf_counter()
            SCENARIOS[name](rank, outdir)
            dist.barrier()
            if rank == 0:
                (Path(outdir) / f"{name}{world}.seconds").write_text(f"{time.perf_counter() - start:.2f}")
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- single process


def _single_process_net(
    steps: int, *, nan: bool, implementation: str, snapshot_at: int | None = None, **options: object
) -> dict:
    net = _Net()
    named = list(net.named_parameters())
    params = [p for _, p in named]
    opt = make_optimizer(params, implementation, named_parameters=named, lr=LR, **options)
    out: dict[str, object] = {"start": _snapshot(named)}
    for k in range(steps):
        if k == snapshot_at:
            out["mid"] = _snapshot(named)
            out["state_dict"] = opt.state_dict()
            out["state_by_name"] = _state_by_name(opt, named)
        set_grads(params, _full_grads(named, k, nan=nan and k == NAN_STEP))
        opt.step()
    out["end"] = _snapshot(named)
    return out


def _single_process_ddp() -> dict:
    """One process, the gradient averaged over both ranks' frames."""
    model = build_model("se_e2_a")
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = HybridMuonOptimizer(params, named_parameters=named, lr=LR)
    start = _snapshot(named)
    for k in range(DDP_STEPS):
        per_rank = []
        for rank in range(WORLD):
            opt.zero_grad(set_to_none=True)
            _loss(model, rank, k).backward()
            per_rank.append([None if p.grad is None else p.grad.clone() for p in params])
        for i, p in enumerate(params):
            gs = [g[i] for g in per_rank]
            p.grad = None if gs[0] is None else sum(g / WORLD for g in gs)
        opt.step()
    return {"start": start, "end": _snapshot(named)}


# ----------------------------------------------------------------------------- fixture


class _Run:
    def __init__(self, outdir: Path, error: str | None, seconds: float) -> None:
        self.outdir, self.error, self.seconds = outdir, error, seconds

    def result(self, name: str, rank: int = 0) -> dict:
        path = self.outdir / f"{name}.rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"scenario {name!r} did not finish; child processes:\n{self.error or 'no error reported'}")
        return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def fsdp_reference() -> dict:
    return _single_process_net(STEPS_BEFORE + STEPS_AFTER, nan=True, implementation="loop", snapshot_at=STEPS_BEFORE)


def _spawn(outdir: Path, world: int, names: tuple[str, ...]) -> tuple[str | None, float]:
    """Run the scenarios ``names`` on ``world`` gloo ranks; the first error (or None) and the seconds.

    A rank killed by a signal (an abort inside gloo or Triton's interpreter, not a Python
    exception) is run once more, in the same folder, and the first attempt's error, with its
    ranks' logs, is given as a warning: such an abort, seen once on a 2-core CI machine, left
    no trace but the signal. A second one is the error.
    """
    first, seconds, signalled = _spawn_once(outdir, world, names)
    if not signalled:
        return first, seconds
    import warnings

    warnings.warn(f"gloo ranks {names} on {world}, {RETRY_WARNING} after: {first}", stacklevel=2)
    error, more, _ = _spawn_once(outdir, world, names)
    return (None if error is None else f"{error}\n(first attempt: {first})"), seconds + more


def _spawn_once(outdir: Path, world: int, names: tuple[str, ...]) -> tuple[str | None, float, bool]:
    """One spawn of :func:`_spawn`: the error (with the ranks' logs), the seconds, whether a rank died by a signal."""
    import torch.multiprocessing as mp

    start = time.perf_counter()
    error, signalled = None, False
    ctx = mp.start_processes(
        _worker, args=(_free_port(), str(outdir), world, names), nprocs=world, join=False, start_method="spawn"
    )
    try:
        while not ctx.join(timeout=1.0):
            if time.perf_counter() - start > SPAWN_TIMEOUT:
                error = f"timed out after {SPAWN_TIMEOUT} s"
                break
    except Exception as exc:  # ProcessRaisedException carries the child's traceback
        error = f"{type(exc).__name__}: {exc}"
        signalled = getattr(exc, "signal_name", None) is not None  # ProcessExitedException by a signal
    finally:
        for proc in ctx.processes:  # only the processes started above
            if proc.is_alive():
                proc.kill()
                proc.join()
    if error is not None:
        for rank in range(world):
            path = outdir / f"rank{rank}.log"
            text = path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"
            error += f"\n--- rank {rank}'s stderr (tail) ---\n{text}"
    return error, time.perf_counter() - start, signalled


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, fsdp_reference: dict) -> _Run:
    outdir = tmp_path_factory.mktemp("distributed")
    torch.save(
        {"params": fsdp_reference["mid"], "state_dict": fsdp_reference["state_dict"]},
        outdir / "single_process_mid.pt",
    )
    error, seconds = _spawn(outdir, WORLD, tuple(SCENARIOS))
    return _Run(outdir, error, seconds)


def _runs_per_world(
    run: _Run, factory: pytest.TempPathFactory, worlds: tuple[int, ...], scenario: str
) -> dict[int, _Run]:
    """``scenario`` spawned on every world size of ``worlds`` (the pair of ``run`` serves ``WORLD``)."""
    runs = {WORLD: run}
    for world in worlds:
        if world != WORLD:
            outdir = factory.mktemp(f"{scenario}{world}")
            error, seconds = _spawn(outdir, world, (scenario,))
            runs[world] = _Run(outdir, error, seconds)
    return runs


@pytest.fixture(scope="module")
def owner_runs(run: _Run, tmp_path_factory: pytest.TempPathFactory) -> dict[int, _Run]:
    """The owner-computes scenario on every world size (2: from the pair of ``run``)."""
    return _runs_per_world(run, tmp_path_factory, OWNER_WORLDS, "owner")


# ----------------------------------------------------------------------------- checks


def _rel_diff(p0: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """|| (a - p0) - (b - p0) || / || b - p0 ||, in float64 (0.0 when a == b)."""
    da, db = (a - p0).double(), (b - p0).double()
    if torch.equal(a, b):
        return 0.0
    return float((da - db).norm() / db.norm().clamp(min=1e-300))


def _worst(start, got, want, names=None) -> dict[str, float]:
    names = names if names is not None else [n for n in want if want[n].numel() > 0]
    return {n: _rel_diff(start[n], got[n], want[n]) for n in names}


def _assert_exact(got: dict, want: dict) -> None:
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"not bitwise equal: {bad}"


def _route(name: str, shape, mode: str = "slice") -> str:
    return F.route_parameter(name, tuple(shape), mode).route


def _assert_matches_loop(start: dict, got: dict, want: dict, mode: str = "slice") -> None:
    """FSDP2 against the single-process loop: Adam routes bitwise, Muon within OWNER_RTOL_MUON."""
    names = [n for n in want if want[n].numel() > 0]
    muon = [n for n in names if _route(n, want[n].shape, mode) == "muon"]
    _assert_exact({n: got[n] for n in names if n not in muon}, {n: want[n] for n in names if n not in muon})
    diffs = _worst(start, got, want, muon)
    assert max(diffs.values(), default=0.0) <= OWNER_RTOL_MUON, diffs


def test_ddp_matches_one_process(run: _Run) -> None:
    """Every rank takes the single-process step of the DDP-averaged gradient, bitwise."""
    ref = _single_process_ddp()
    r0, r1 = run.result("ddp", 0), run.result("ddp", 1)
    _assert_exact(r0["params"], r1["params"])
    _assert_exact(r0["params"], ref["end"])
    assert any(not torch.equal(ref["start"][n], ref["end"][n]) for n in ref["end"])


def test_zero1_matches_one_process_and_resumes(run: _Run) -> None:
    total = STEPS_BEFORE + STEPS_AFTER
    loop = _single_process_net(total, nan=False, implementation="loop", snapshot_at=STEPS_BEFORE)
    engine = _single_process_net(total, nan=False, implementation="engine")
    r0, r1 = run.result("zero", 0), run.result("zero", 1)
    # Both ranks own parameters, and every parameter is owned once.
    for label in ("loop", "engine"):
        assert r0[f"{label}_owned"] and r1[f"{label}_owned"]
        assert not set(r0[f"{label}_owned"]) & set(r1[f"{label}_owned"])
        _assert_exact(r0[f"{label}_end"], r1[f"{label}_end"])
    # The per-parameter loop does not depend on which parameters share a rank: bitwise.
    _assert_exact(r0["loop_mid"], loop["mid"])
    _assert_exact(r0["loop_end"], loop["end"])
    # The flat engine sums Magma over each rank's partition: roundings differ.
    start = engine["start"]
    diffs = _worst(start, r0["engine_end"], engine["end"])
    too_far = {
        n: d
        for n, d in diffs.items()
        if d > (ENGINE_RTOL_MUON if _route(n, start[n].shape) == "muon" else ENGINE_RTOL_ADAM)
    }
    assert not too_far, too_far

    # consolidate_state_dict(to=0) + state_dict() resumes a fresh single-process optimizer.
    net = _Net()
    named = list(net.named_parameters())
    with torch.no_grad():
        for n, p in named:
            p.copy_(r0["loop_mid"][n])
    params = [p for _, p in named]
    opt = make_optimizer(params, "loop", named_parameters=named, lr=LR)
    opt.load_state_dict(r0["state_dict"])
    assert opt.state_routing_mismatches() == []
    for k in range(STEPS_BEFORE, total):
        set_grads(params, _full_grads(named, k))
        opt.step()
    _assert_exact(_snapshot(named), loop["end"])


def test_zero1_accepts_deepmd_trainer_kwargs(run: _Run) -> None:
    """ZeRO-1 built as deepmd's trainer builds it (flash_muon=..., use_foreach=... keywords)."""
    error = run.result("zero", 0)["trainer_kwargs_error"]
    assert error is None, error


def test_zero1_restart_checks_the_checkpoint_before_anything_changes(run: _Run) -> None:
    """ZeRO-1 copies the state into each rank's optimizer itself: the plugin checks it first.

    Its own checkpoints and deepmd-kit 3.1's load, and the input's settings win; bad ones are refused
    with nothing changed.
    """
    for rank in (0, 1):
        written, group, shape, legacy = run.result("zero", rank)["restart_refused"]
        assert written == "loaded | [(0.5, 'slice')]", written  # the input's momentum, not the checkpoint's 0.95
        assert "momentum" in group and "1.5" in group and group.endswith("state left empty: True"), group
        assert "momentum_buffer" in shape and shape.endswith("state left empty: True"), shape
        assert legacy == "loaded | [(0.5, 'slice')]", legacy  # the input's, not 3.1's muon_2d_only (2d)


def test_zero1_nan_skips_the_whole_step(run: _Run) -> None:
    """With nonfinite_across_ranks (set by the plugin for zero_stage 1) no rank steps."""
    for rank in (0, 1):
        for key in ("moved_in_nan_step", "moved_in_nan_step_loop"):
            moved = run.result("zero", rank)[key]
            assert moved == [], f"rank {rank}, {key}: {len(moved)} parameters moved in a step with a NaN gradient"


def test_zero1_nan_skips_only_its_group(run: _Run) -> None:
    """With nonfinite_across_ranks and two param_groups, a NaN in the first group's gradients skips that group on
    every rank and the second steps: one process's step, bitwise."""
    net = _Net()
    named = list(net.named_parameters())
    opt = make_optimizer(_two_groups(net), "loop", named_parameters=named, lr=LR)
    start = _snapshot(named)
    set_grads([p for _, p in named], _full_grads(named, NAN_STEP, nan=True))
    opt.step()
    want = _snapshot(named)
    assert all(torch.equal(want[n], start[n]) for n, _ in named if n.startswith("extra."))
    assert any(not torch.equal(want[n], start[n]) for n, _ in named if n.startswith("model."))
    for rank in range(WORLD):
        _assert_exact(run.result("zero", rank)["two_groups_nan"], want)


def test_zero1_without_the_flag_skips_only_the_owning_partition(run: _Run) -> None:
    """The default: each rank gates its own partition, so the other rank's parameters move."""
    moved = run.result("zero", 0)["moved_in_nan_step_local"] + run.result("zero", 1)["moved_in_nan_step_local"]
    assert moved, "expected the rank without the NaN to step its partition"


def test_fsdp2_matches_one_process(run: _Run, fsdp_reference: dict) -> None:
    """Default options (Gram path, Magma) on sharded DTensors == the single-process loop."""
    res = run.result("fsdp2", 0)
    ref = fsdp_reference
    assert [row["implementation"] for row in res["table"]] == ["fsdp2"]
    # uneven and empty shards are in the test
    r1 = run.result("fsdp2", 1)
    assert res["local_shapes"]["extra.lowrank"] == (4, 10) and r1["local_shapes"]["extra.lowrank"] == (3, 10)
    assert res["local_shapes"]["extra.slab"] == (2, 5, 6) and r1["local_shapes"]["extra.slab"] == (1, 5, 6)
    assert 0 in {s[0] for s in r1["local_shapes"].values() if s}
    # Both ranks hold the same parameters.
    _assert_exact(res["end"], r1["end"])
    # Adam routes bitwise; Muon within the rounding of Magma's partial sums (see OWNER_RTOL_MUON).
    _assert_matches_loop(ref["start"], res["mid"], ref["mid"])
    _assert_matches_loop(ref["start"], res["end"], ref["end"])
    # The NaN step was skipped on both ranks (by the single process too): nothing is NaN.
    assert all(torch.isfinite(t).all() for t in res["end"].values())
    # Against the default single process (flat engine): its rounding.
    engine = _single_process_net(STEPS_BEFORE + STEPS_AFTER, nan=True, implementation="engine")
    diffs = _worst(ref["start"], res["end"], engine["end"])
    too_far = {
        n: d
        for n, d in diffs.items()
        if d > (ENGINE_RTOL_MUON if _route(n, ref["start"][n].shape) == "muon" else ENGINE_RTOL_ADAM)
    }
    assert not too_far, too_far


def test_fsdp2_other_options_on_a_2d_mesh(run: _Run) -> None:
    """Magma off, standard Newton–Schulz, "flat" views, HSDP placements: the loop's result, bitwise."""
    res = run.result("fsdp2", 0)
    assert res["other_placements"] == "(Replicate(), Shard(dim=0))"
    ref = _single_process_net(STEPS_BEFORE + STEPS_AFTER, nan=True, implementation="loop", **OTHER_OPTIONS)
    _assert_exact(res["other_end"], ref["end"])
    _assert_exact(res["other_end"], run.result("fsdp2", 1)["other_end"])


def test_fsdp2_gradients_and_state_laid_out_otherwise(run: _Run) -> None:
    """Replicate() gradients of Shard(0) parameters, and a state dict whose state tensors are Replicate(), are laid
    out like the parameters first: the same steps as with FSDP2's own layout, bitwise (the redistribution slices)."""
    for rank in range(WORLD):
        res = run.result("fsdp2", rank)
        _assert_exact(res["replicated_grads_end"], res["sharded_grads_end"])
        _assert_exact(res["replicated_state_end"], res["sharded_state_end"])


def test_fsdp2_with_the_gate_agreed_over_all_ranks(run: _Run) -> None:
    """nonfinite_across_ranks (the optimizer's gate, all-reduced over every rank): the group adds no gate all-reduce
    of its own (Magma's and the two exchanges remain), and the steps are the default's, bitwise, the NaN step too."""
    for rank in range(WORLD):
        res = run.result("fsdp2", rank)
        assert res["shared_gate_trace"] == ["all_reduce", "all_to_all", "all_to_all"] * (STEPS_BEFORE + STEPS_AFTER)
        _assert_exact(res["shared_gate_end"], res["end"])


def test_fsdp2_runs_the_phases_in_the_one_order(run: _Run) -> None:
    from test_step import ALL_PHASES

    for rank in range(WORLD):
        runs = run.result("fsdp2", rank)["phases"]
        expected = ("deepmd_hybridmuon.distributed.fsdp.ShardedStep", ALL_PHASES)
        assert [tuple(r) for r in runs] == [expected] * (STEPS_BEFORE + STEPS_AFTER), (rank, runs)


def test_fsdp2_huge_finite_muon_gradients(run: _Run) -> None:
    """Muon gradients of 1e20 and 1e30 (float32, bfloat16) and float16's largest step as the same gradients scaled
    down to about 1; float32's largest skips.

    Newton–Schulz and Magma's cosine are scale-invariant, and the arithmetic scales a matrix by a
    power of two first, so a power-of-two scaling changes nothing, bitwise. (A scaling by another
    factor rounds the inputs differently, and Newton–Schulz amplifies that rounding in the null
    space of a rank-deficient matrix: measured, ``extra.square_lowrank``'s step at 1e20 differed from
    its step at 1 by 1.17 times that step's size.) 2^127 and more is skipped like a non-finite
    gradient (functional.GRAD_LIMIT).
    """
    huge = run.result("fsdp2", 0)["huge"]
    taken = [(torch.float32, s) for s in HUGE_SCALES[:-1]] + list(HUGE_HALF)
    for dtype, scale in [*taken, (torch.float32, HUGE_SCALES[-1])]:
        start = huge[f"start {dtype}"]
        names = [n for n in start if start[n].numel() > 0]
        key = f"{dtype} {scale}"
        assert huge[f"state_finite_{key}"], key
        if (dtype, scale) not in taken:  # skipped
            _assert_exact({n: huge[key][n] for n in names}, {n: start[n] for n in names})
            continue
        assert all(torch.isfinite(huge[key][n]).all() for n in names), key
        muon = [n for n in names if _route(n, start[n].shape) == "muon"]
        # the step was taken (in half precision, a step of LR can stay below a whole matrix's rounding)
        moved = [not torch.equal(huge[key][n], start[n]) for n in muon]
        assert all(moved) if dtype == torch.float32 else any(moved), key
        got, want = {n: huge[key][n] for n in names}, {n: huge[f"{key} scaled down"][n] for n in names}
        if dtype == torch.float32:
            _assert_exact(got, want)
            continue
        # Half precision: a Newton-Schulz input can differ in its last bit (Muon's norm plus NS_EPS
        # rounds differently when a matrix of a slice is not scaled down), which moves a rank-deficient
        # matrix's parameters by a bfloat16 ulp (2^-8 relative, about one step of LR) in places:
        # measured 1.0e-2 of the step's norm, on one matrix (the others bitwise). 2^-5 bounds it.
        worst = _worst(start, got, want)
        assert max(worst.values()) <= 2**-5, (key, worst)


def test_fsdp2_state_layout(run: _Run, fsdp_reference: dict) -> None:
    """Parameter-shaped state is DTensor, Magma scores plain (batch,) float32, equal on all ranks."""
    r0, r1 = run.result("fsdp2", 0), run.result("fsdp2", 1)
    kinds = r0["state_kinds"]
    ref_state = fsdp_reference["state_by_name"]
    assert set(kinds) == set(ref_state)
    for name, state in kinds.items():
        for key, (kind, shape) in state.items():
            if key == "magma_score":
                assert kind == "Tensor", (name, key, kind)
                assert shape == tuple(ref_state[name][key].shape)
            else:
                assert kind == "DTensor", (name, key, kind)
    assert r0["magma_scores"].keys() == r1["magma_scores"].keys() and r0["magma_scores"]
    for name, score in r0["magma_scores"].items():
        assert score.dtype == torch.float32
        assert torch.equal(score, r1["magma_scores"][name]), name
    # The full optimizer state dict (torch.distributed.checkpoint) holds the single
    # process's state, keyed by parameter name: bitwise, but for the Magma scores, whose
    # cosines come from per-shard float32 sums added across ranks (another order of
    # summation than one process's): a few float32 roundings of a score in [0, 1], far
    # below 1e-5 (unequal in the last bits on one 2-core x86 machine, equal on CI's).
    osd = r0["full_osd_state"]
    assert set(osd) == set(ref_state)
    for name, state in ref_state.items():
        assert set(osd[name]) == set(state), name
        for key, value in state.items():
            got = osd[name][key]
            if key == "magma_score":
                assert type(got) is torch.Tensor, (name, key)
                torch.testing.assert_close(got, value, rtol=0, atol=1e-5, msg=f"{name} {key}")
            elif isinstance(value, torch.Tensor):
                assert type(got) is torch.Tensor and torch.equal(got, value), (name, key)
            else:
                assert got == value, (name, key)
    # A full single-process checkpoint loaded with load_state_dict became DTensor state.
    after = r0["state_kinds_after_plain_load"]
    for name, state in after.items():
        for key, kind in state.items():
            assert kind == ("Tensor" if key == "magma_score" else "DTensor"), (name, key, kind)


def test_fsdp2_checkpoint_resumes(run: _Run, fsdp_reference: dict) -> None:
    """get/set_optimizer_state_dict (full, broadcast from rank 0): resumed == continuous, bitwise."""
    res = run.result("fsdp2", 0)
    _assert_exact(res["resumed_params"], res["mid"])
    _assert_exact(res["loaded_params"], fsdp_reference["mid"])
    _assert_exact(res["end_resumed"], res["end"])
    _assert_matches_loop(fsdp_reference["start"], res["end_single_process_checkpoint"], fsdp_reference["end"])


def test_children_finish(run: _Run) -> None:
    """Both processes ran every scenario; prints the module's cost (spawn, imports, scenarios)."""
    seconds = {p.stem: float(p.read_text()) for p in run.outdir.glob("*.seconds")}
    print(f"\ndistributed: {run.seconds:.1f} s wall for the pair of processes; scenarios {seconds}", file=sys.stderr)
    assert run.error is None, run.error


# ----------------------------------------------------------------------------- checks: the owner computes


def _owner_reference(options: dict, net: torch.nn.Module | None = None, steps: int = OWNER_STEPS) -> dict:
    """The single-process loop on ``net`` (default: the synthetic model) with :func:`_owner_grads`."""
    net = _Synthetic(1) if net is None else net
    named = list(net.named_parameters())
    params = [p for _, p in named]
    opt = make_optimizer(params, "loop", named_parameters=named, lr=LR, **options)
    start = _snapshot(named)
    for k in range(steps):
        for p, g in zip(params, _owner_grads(named, k), strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
    return {"start": start, "end": _snapshot(named)}


def _owner(owner_runs: dict[int, _Run], world: int, rank: int = 0) -> dict:
    return owner_runs[world].result(f"owner{world}", rank)


@pytest.mark.parametrize("world", OWNER_WORLDS)
@pytest.mark.parametrize("label", list(OWNER_OPTIONS))
def test_fsdp2_owner_matches_one_process(owner_runs: dict[int, _Run], world: int, label: str, monkeypatch) -> None:
    """2-D, 3-D slice, flat, AdamW, Adam and grad-less parameters, Gram and Magma on, against one process."""
    if OWNERS_KERNELS == "triton":  # the kernels compute the GPU's arithmetic: so does the reference
        monkeypatch.setattr(F, "STANDARD_FORM_DEVICES", frozenset())
    res = _owner(owner_runs, world)
    shapes = res[f"{label}/1/local_shapes"]
    assert any(s["blocks.0.p.tiny"][0] == 0 for s in shapes) == (world > 2)  # empty shards
    assert any(s["blocks.0.p.lead1"][0] == 0 for s in shapes)
    ref = _owner_reference(OWNER_OPTIONS[label])
    got = res[f"{label}/1/end"]
    assert torch.equal(got["blocks.0.p.nograd"], ref["start"]["blocks.0.p.nograd"])
    muon = {n for n in got if _route(n, got[n].shape, label) == "muon"}
    assert {"blocks.0.p.w2d", "blocks.0.p.slab", "blocks.0.p.lead1"} <= muon
    _assert_matches_loop(ref["start"], got, ref["end"], label)
    for rank in range(1, world):
        _assert_exact(_owner(owner_runs, world, rank)[f"{label}/1/end"], got)
    # The owners' Newton–Schulz: the engine's Triton launches where Triton runs (here, under its
    # interpreter: test_owners_run_the_triton_kernels_under_the_interpreter), for every owned
    # shape (all at most MAX_ROWS here); torch otherwise.
    [row] = res[f"{label}/1/table"]
    assert (row["implementation"], row["kernels"]) == ("fsdp2", OWNERS_KERNELS), row
    assert (row["torch_matrices"] == []) == (OWNERS_KERNELS == "triton"), row


@pytest.mark.parametrize("world", OWNER_WORLDS)
def test_fsdp2_owner_plan_and_transport(owner_runs: dict[int, _Run], world: int) -> None:
    """One plan on every rank; each matrix owned once; the two all-to-alls move bits unchanged."""
    res = _owner(owner_runs, world)
    for label in OWNER_OPTIONS:
        for copies in OWNER_COPIES:
            key = f"{label}/{copies}"
            plans = res[f"{key}/plans"]
            assert len(plans) == world and all(p == plans[0] for p in plans)
            owned = res[f"{key}/owned"]
            assert sorted(i for ids in owned for i in ids) == list(range(res[f"{key}/num_matrices"]))
            load = res[f"{key}/load"]
            assert max(load) <= 2 * sum(load) / world  # balanced (greedy longest-first)
            for rank in range(world):
                r = _owner(owner_runs, world, rank)
                assert r[f"{key}/transport_owned_exact"] and r[f"{key}/transport_back_exact"], (key, rank)
                assert [kind for kind, _ in r[f"{key}/transport_trace"]] == ["all_to_all", "all_to_all"]


@pytest.mark.parametrize("use_gram", [True, False])
def test_owner_plan_counts_each_schedules_iterations(use_gram: bool) -> None:
    """The owners' balance counts iterations: a square matrix's ten standard ones cost twice the Gram schedule's five.

    One (16, 16) matrix and two (8, 64) ones, all of 16 * 16 * 16 = 8 * 64 * 8 products' flops per iteration: with
    ``enable_gram`` the square one alone weighs as much as both rectangular ones, so it is owned alone; without it
    every matrix takes the standard schedule and three equal costs split two and one.
    """
    from deepmd_hybridmuon.distributed import build_plan

    shapes = [(16, 16), (8, 64), (8, 64)]
    entries = [(i, s, F.route_parameter(f"w{i}", s, "slice")) for i, s in enumerate(shapes)]
    plan = build_plan(entries, 2, use_gram)
    square, *rect = (owners[0] for owners in plan.owners)
    assert (square not in rect) == use_gram, plan.owners
    share = (1, 2) if use_gram else (2, 3)  # the larger rank's part of the whole load
    assert max(plan.load) * share[1] == sum(plan.load) * share[0], plan.load


@pytest.mark.parametrize("world", OWNER_WORLDS)
def test_fsdp2_owner_nan_skips_every_rank(owner_runs: dict[int, _Run], world: int) -> None:
    """A NaN in the last rank's shard of one matrix: no parameter moves on any rank."""
    res = _owner(owner_runs, world)
    for label in OWNER_OPTIONS:
        for copies in OWNER_COPIES:
            assert res[f"{label}/{copies}/moved_in_nan_step"] == [], (label, copies)


@pytest.mark.parametrize("world", OWNER_WORLDS)
def test_fsdp2_owner_collectives(owner_runs: dict[int, _Run], world: int) -> None:
    """Every rank issues the same collectives; their number does not grow with the parameters.

    Per step and param_group: the gate all-reduce, Magma's all-reduce, two all-to-alls.
    """
    res = _owner(owner_runs, world)
    for label in OWNER_OPTIONS:
        kinds = {}
        for copies in OWNER_COPIES:
            traces = res[f"{label}/{copies}/traces"]
            assert all(t == traces[0] for t in traces), (label, copies)  # same on every rank, sizes too
            kinds[copies] = [[kind for kind, _ in step] for step in traces[0]]
            assert all(step == ["all_reduce", "all_reduce", "all_to_all", "all_to_all"] for step in kinds[copies])
        assert kinds[OWNER_COPIES[0]] == kinds[OWNER_COPIES[-1]]


def test_plugin_on_two_ranks(run: _Run) -> None:
    """deepmd's trainer on 2 ranks: a plain HybridMuonOptimizer at zero_stage 0 (every replica steps the whole
    group: test_ddp_matches_one_process); ZeRO-1's local optimizer makes the ranks agree on skipping, and
    ZeroRedundancyOptimizer keeps each rank's parameters in one bucket (one broadcast per rank)."""
    for rank in range(WORLD):
        flags = run.result("ddp", rank)["plugin_flags"]
        assert flags == {0: (HybridMuonOptimizer, False, None), 1: (HybridMuonOptimizer, True, True)}


#: The GPU scripts' model, optimizer and step (no braces: FSDP_ON_GPU is a ``str.format`` template).
#: ``step`` gives every model (sharded or not, on every rank) the same seeded gradients: no
#: feedback of the parameters; inside ``with torch.device("cuda")``, as deepmd's trainer; with
#: ``check``, under the sync debug mode "error" (a host wait raises).
GPU_MODEL = """
from torch.distributed.tensor import distribute_tensor
torch.manual_seed(0)
def model():  # weights on every path: one program each (64 x 600 streamed), the torch path (200 x 160, 240 x 200)
    layers = [torch.nn.Linear(600, 64), torch.nn.Tanh(), torch.nn.Linear(64, 160), torch.nn.Tanh()]
    layers += [torch.nn.Linear(160, 200), torch.nn.Tanh(), torch.nn.Linear(200, 240), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(240, 16)).cuda()
def optimizer(net, **options):
    return HybridMuonOptimizer(
        net.parameters(), lr=1e-2, weight_decay=0.01, magma_muon=True, named_parameters=net.named_parameters(),
        **options
    )
def step(net, opt, k, check=False):
    gen = torch.Generator().manual_seed(k)
    for p in net.parameters():
        g = torch.randn(p.shape, generator=gen).cuda()
        sharded = hasattr(p, "placements")
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if sharded else g
    torch.cuda.synchronize()
    if check:
        torch.cuda.set_sync_debug_mode("error")
    with torch.device("cuda"):
        opt.step()
    torch.cuda.set_sync_debug_mode("default")
    opt.zero_grad()
"""


# The FSDP2 step on a GPU must not make the host wait for it: every wait stalls the launch of
# the rest of the step. On one GPU (NCCL, world size 1) and on two: the owners' Newton–Schulz
# runs the engine's Triton launches on every path (a first optimizer waits for their compilation,
# so the measured one finds them loaded), the step is captured as CUDA graphs with the
# collectives between them from its third step on, and the result is the loop's on an unsharded
# copy. In subprocesses, so that this process's torch.distributed stays uninitialised for the other tests.
FSDP_ON_GPU = (
    """
import copy, os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="{rank}", WORLD_SIZE="{world}")
torch.cuda.set_device({rank})
dist.init_process_group("nccl")
from torch.distributed.fsdp import fully_shard
from deepmd_hybridmuon import HybridMuonOptimizer
"""
    + GPU_MODEL
    + """
warm = model()
fully_shard(warm)
warm_opt, deadline = optimizer(warm), time.monotonic() + 240
while True:  # every rank steps as often as the others: each step is a sequence of collectives
    step(warm, warm_opt, 0)
    done = warm_opt.execution_table()[0].get("kernels") != "compiling" or time.monotonic() > deadline
    flag = torch.tensor(float(done), device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item():
        break
    time.sleep(0.5)
net = model()
ref = copy.deepcopy(net)
start = [p.detach().clone() for p in net.parameters()]
fully_shard(net)
opt, ref_opt = optimizer(net), optimizer(ref)
ref_opt._implementation = "loop"
for k in range(5):
    step(net, opt, k, check=k >= 3)
    step(ref, ref_opt, k)
    if k == 2:  # captured at its third step: the checked steps replay the graphs
        print("captured", opt.execution_table()[0]["cuda_graph"])
errors = []
for (name, p), r, p0 in zip(net.named_parameters(), ref.parameters(), start):
    moved, expected = p.full_tensor() - p0, r.detach() - p0
    errors.append(float((moved - expected).norm() / expected.norm()))
row = opt.execution_table()[0]
print(row["torch_matrices"])
print(row["implementation"], row["kernels"], row["cuda_graph"], max(errors))
dist.destroy_process_group()
"""
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_on_gpus_runs_the_kernels_and_graphs_matches_the_loop_and_never_waits(world: int, tmp_path: Path) -> None:
    import subprocess

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    port, ranks, logs = _free_port(), [], []
    try:
        for rank in range(world):  # output to files: no pipe fills while another rank is awaited
            logs.append((tmp_path / f"rank{rank}.out", tmp_path / f"rank{rank}.err"))
            with open(logs[-1][0], "w") as out, open(logs[-1][1], "w") as err:
                script = FSDP_ON_GPU.format(port=port, rank=rank, world=world)
                ranks.append(subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=err))
        deadline = time.monotonic() + 400  # one deadline for all: a rank that dies leaves the others waiting in NCCL
        while any(proc.poll() is None for proc in ranks) and time.monotonic() < deadline:
            if any(proc.poll() not in (None, 0) for proc in ranks):
                break
            time.sleep(0.5)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    outputs = [(out.read_text(), err.read_text()[-3000:]) for out, err in logs]
    torch_matrices, kernels = [], set()
    for proc, (out, _) in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0, outputs  # sync debug mode "error" raises on a host wait
        captured, shapes, last = out.splitlines()[-3:]
        implementation, rank_kernels, graph, worst = last.split()
        assert (captured, implementation, graph) == ("captured True", "fsdp2", "True"), out
        kernels.add(rank_kernels)  # "torch" on a rank that owns only matrices of the torch path
        torch_matrices += ast.literal_eval(shapes)
        # the owners' Triton launches against the loop's cuBLAS chain: test_parity's kernel tolerance,
        # on the norm of each parameter's change over the 5 steps, as test_parity measures it
        # (measured on 2 H100s, 2026-11-27, 5 steps: 5.0e-3;
        # Adam routes 0.0)
        assert float(worst) <= KERNEL_MUON_TOL, out
    assert "triton" in kernels and kernels <= {"triton", "torch"}, outputs
    # smaller side > MAX_ROWS: the torch path, on whichever rank owns the matrix
    assert sorted(torch_matrices) == [(200, 160), (240, 200)], outputs


@pytest.mark.skipif(torch.cuda.is_available() or OWNERS_KERNELS == "triton", reason="runs the selection interpreted")
def test_owners_run_the_triton_kernels_under_the_interpreter() -> None:
    """FSDP2 owners on the engine's Triton launches: the one-process loop's result, to tolerance."""
    from conftest import run_interpreted

    select = "fsdp2_owner_matches_one_process and (slice-2 or flat-2)"
    run_interpreted(__file__, select)
