"""The flat engine's life cycle: its state layout, and its rebuilds and fallbacks, each against the loop.

The parity of every implementation with the loop over the option sets is tests/test_parity.py.
"""

from __future__ import annotations

import operator
import weakref

import pytest
import torch
from conftest import make_optimizer
from test_parity import ADAM_TOL, TORCH_MUON_TOL
from test_parity import SHAPES as PARITY_SHAPES

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon import functional as F

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# The parity table's shapes without its never-differentiated matrix: here every parameter gets a gradient.
SHAPES = {k: v for k, v in PARITY_SHAPES.items() if k != "frozen.matrix"}


def _params(dtype: torch.dtype, device: str) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype).to(device)) for k, s in SHAPES.items()}


def _run(implementation: str, dtype: torch.dtype, device: str, steps: int = 6, **options):
    params = _params(dtype, device)
    opt = make_optimizer(list(params.values()), implementation, lr=1e-2, named_parameters=params.items(), **options)
    gen = torch.Generator().manual_seed(1)
    start = {k: p.detach().clone() for k, p in params.items()}
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype).to(device)
        opt.step()
    return {k: (p.detach() - start[k]) for k, p in params.items()}, opt


def _assert_close_to_the_loop(engine: dict, loop: dict, names: dict, muon_tol: float = TORCH_MUON_TOL) -> None:
    """What each parameter moved, engine against loop, with the tolerances of tests/test_parity.py."""
    for name, r in loop.items():
        if r.numel() == 0:
            continue
        err = ((engine[name] - r).norm() / r.norm()).item()
        # Muon: bf16 roundings in another order (TORCH_MUON_TOL); Adam: the same float32 operations.
        assert err < (muon_tol if names[name] == "muon" else ADAM_TOL), (name, err)


@pytest.mark.parametrize("device", DEVICES)
def test_state_is_the_builtin_layout_and_survives_a_round_trip(device):
    _, opt = _run("engine", torch.float32, device, steps=2)
    assert opt.execution_table()[0]["implementation"] == "engine"
    sd = opt.state_dict()
    for p in opt.param_groups[0]["params"]:
        if p.numel() == 0:
            continue
        state = opt.state[p]
        # per-parameter tensors, shaped like the built-in's, even though they are views
        if "momentum_buffer" in state:
            assert state["momentum_buffer"].shape == p.shape
        if "exp_avg" in state:
            assert state["exp_avg"].shape == p.shape and state["exp_avg"].dtype == torch.float32
            assert isinstance(state["beta1_pow"], float)
    # saved tensors do not share the engine's flat buffers
    saved = [t for s in sd["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in saved)


def _routes(opt, params: dict) -> dict:
    group = opt.param_groups[0]
    return {name: opt.route_of(p, group).route for name, p in params.items()}


def _scripted_run(implementation: str, script, device: str = "cpu", steps: int = 5) -> tuple[dict, dict, object]:
    """Steps driven by ``script(step, params, opt)`` (which sets the gradients); what each parameter moved."""
    params = _params(torch.float32, device)
    start = {k: p.detach().clone() for k, p in params.items()}
    opt = make_optimizer(list(params.values()), implementation, lr=1e-2, named_parameters=params.items())
    gen = torch.Generator().manual_seed(4)
    for step in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen).to(device, p.dtype)
        script(step, params, opt)
        opt.step()
    return {k: p.detach() - start[k] for k, p in params.items()}, params, opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("missing", ["fit.layers.1.matrix", "emb.layers.2.bias"], ids=["muon", "adam"])
def test_engine_follows_a_parameter_that_misses_a_gradient(missing, device):
    def script(step, params, opt):
        if step == 2:
            # This step the parameter must not move (the engine masks it), then it steps again: a missed or
            # extra step shows as a 20 % difference.
            # An Adam parameter is one step count behind the others from then on, with its own
            # bias corrections (about 10 % of its step at step 5).
            params[missing].grad = None

    # 7 steps: on a GPU, two eager steps, the masked step (eager), then captured ones
    moved, params, opt = _scripted_run("engine", script, device, steps=7)
    ref, _, _ = _scripted_run("loop", script, device, steps=7)
    _assert_close_to_the_loop(moved, ref, _routes(opt, params))
    row = opt.execution_table()[0]
    assert row["implementation"] == "engine"  # back on the engine after that step
    assert row["cuda_graph"] == (device == "cuda")  # the engine, not the loop, took the later steps


#: Two branches of a multi-task model, each with Muon matrices and Adam and AdamW parameters (tests/test_parity.py's
#: shapes and routes); the rest is shared.
BRANCHES = (
    {"fit.layers.0.matrix", "fit.layers.1.matrix", "fit.layers.1.idt", "rep.ls.adamw_gamma"},
    {"rep.linear.weight", "rep.gate.weight", "rep.norm.adam_scale", "emb.layers.2.bias"},
)


def _branch_run(implementation: str, device: str, without: str, steps: int = 8) -> tuple[dict, dict, object, list]:
    """Steps that train both branches, then one branch at a time (the other's gradients None); what each moved.

    The model lacks the parameter ``without`` (or ""). Step 5 has a NaN in a gradient (a skipped step), step 6 no
    gradient at all. Also, per step, each parameter without a gradient: whether its value and state stayed bit for bit.
    """
    params = {k: p for k, p in _params(torch.float32, device).items() if k != without}
    start = {k: p.detach().clone() for k, p in params.items()}
    opt = make_optimizer(list(params.values()), implementation, lr=1e-2, named_parameters=params.items())
    gen = torch.Generator().manual_seed(5)
    kept = []
    for step in range(steps):
        off = set(params) if step == 6 else BRANCHES[step % 2] & set(params) if step >= 2 else set()
        for name, p in params.items():
            p.grad = None if name in off else torch.randn(p.shape, generator=gen).to(device, p.dtype)
        if step == 5:  # a NaN in a gradient of the trained branch: the whole step is skipped, as in the loop
            params["emb.layers.1.matrix"].grad[0, 0] = float("nan")
        before = {n: (params[n].detach().clone(), {k: _copy(v) for k, v in opt.state[params[n]].items()}) for n in off}
        opt.step()
        for name, (value, state) in before.items():
            now = opt.state[params[name]]
            kept.append(
                (
                    step,
                    name,
                    torch.equal(params[name], value)
                    and state.keys() == now.keys()
                    and all(_same(state[k], now[k]) for k in state),
                )
            )
    return {k: p.detach() - start[k] for k, p in params.items()}, params, opt, kept


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("without", ["", "rep.ls.adamw_gamma"], ids=["all-routes", "no-adamw"])
@pytest.mark.parametrize("device", DEVICES)
def test_branches_that_take_turns_step_as_in_the_loop(device, without):
    # A multi-task model trains one branch per step: the other branch's parameters have no gradient and keep their
    # values and state bit for bit (no decay, no momentum or moment blend, no Magma score, no Adam step count), and
    # the engine steps the rest as the loop does, without building itself again (the state stays in place). With
    # weight decay, with and without an AdamW-routed parameter.
    moved, params, opt, kept = _branch_run("engine", device, without)
    ref, _, _, kept_ref = _branch_run("loop", device, without)
    assert [k for k in kept_ref if not k[2]] == []  # the loop, as the reference
    assert [k for k in kept if not k[2]] == []
    _assert_close_to_the_loop(moved, ref, _routes(opt, params))
    row = opt.execution_table()[0]
    assert row["implementation"] == "engine"
    assert row["cuda_graph"] == (device == "cuda")  # the branch steps are captured too
    # the state tensors of step 2 are those of the last step: the engine was not built again
    muon = [n for n, route in _routes(opt, params).items() if route == "muon"]
    held = {n: weakref.ref(opt.state[params[n]]["momentum_buffer"]) for n in muon}
    for _ in range(2):
        for name, p in params.items():
            p.grad = None if name in BRANCHES[0] else torch.randn_like(p)
        opt.step()
    assert all(ref() is opt.state[params[n]]["momentum_buffer"] for n, ref in held.items())


@pytest.mark.parametrize("device", DEVICES)
def test_a_parameter_rerouted_while_it_has_no_gradient_keeps_its_state(device):
    # Renamed between steps so that its route changes (Muon -> Adam) in a step where it has no gradient: the loop
    # leaves it and its Muon state alone; so must the engine (its state is not its route's: it is left out).
    def run(implementation: str):
        gen = torch.Generator().manual_seed(2)
        w, v, b = (torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((8, 8), (8, 8), (8,)))
        named = [("fit.matrix", w), ("other.matrix", v), ("shared.bias", b)]
        opt = make_optimizer([w, v, b], implementation, lr=1e-2, named_parameters=named)
        for step in range(4):
            for _, p in named:
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            if step == 2:
                opt.set_param_names([("fit.adam_matrix", w), ("other.matrix", v), ("shared.bias", b)])
                w.grad = None
                before = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
            opt.step()
            if step == 2:
                assert torch.equal(w, before[0]) and torch.equal(opt.state[w]["momentum_buffer"], before[1])
        return {n: p.detach().clone() for n, p in named}

    engine, loop = run("engine"), run("loop")
    for name, value in loop.items():
        torch.testing.assert_close(engine[name], value, rtol=TORCH_MUON_TOL, atol=0, msg=name)


def test_a_matrix_frozen_after_steps_leaves_the_step():
    # Frozen (requires_grad off, no gradient) after two steps, with its state: the step no longer orthogonalises it,
    # where a trainable matrix without a gradient (another branch) stays in the step, masked.
    params = _params(torch.float32, "cpu")
    opt = make_optimizer(list(params.values()), "engine", lr=1e-2, named_parameters=params.items())

    def matrices(frozen: set[str], idle: set[str]) -> int:
        for name, p in params.items():
            p.requires_grad_(name not in frozen)
            p.grad = None if name in frozen | idle else torch.randn_like(p)
        opt.step()
        row = opt.execution_table()[0]
        return row["program_matrices"] + len(row["torch_matrices"])

    everything = matrices(set(), set())
    assert matrices(set(), {"fit.layers.1.matrix"}) == everything  # another branch's: masked, still held
    assert matrices({"fit.layers.1.matrix"}, set()) == everything - 1


def _saved_state(opt, params: dict) -> dict:
    """Each parameter's saved state (``state_dict()["state"]``), by name."""
    names = list(params)  # the group's parameters, in order
    return {names[i]: entry for i, entry in opt.state_dict()["state"].items()}


def _assert_state_is_the_loops(engine, loop, params: dict) -> None:
    """The same state entries as the loop's, the same keys, the same values and dtypes.

    The momentum and the Adam moments depend on the gradients alone, the Magma scores on them and the momentum:
    only summation orders differ (Magma's sums), not the step's rounding of the parameters.
    """
    engine, loop = _saved_state(engine, params), _saved_state(loop, params)
    assert engine.keys() == loop.keys()
    for name, entry in loop.items():
        assert engine[name].keys() == entry.keys(), name
        for key, value in entry.items():
            torch.testing.assert_close(engine[name][key], value, msg=f"{name} {key}")


#: Changes of the optimizer's state between two steps, and the parameter they concern.
STATE_EDITS = {
    "clear": lambda opt, p: opt.state.clear(),
    "del-muon": lambda opt, p: operator.delitem(opt.state, p),  # del opt.state[p]
    "del-adam": lambda opt, p: operator.delitem(opt.state, p),
    "del-momentum": lambda opt, p: operator.delitem(opt.state[p], "momentum_buffer"),
    "new-momentum": lambda opt, p: operator.setitem(opt.state[p], "momentum_buffer", torch.ones_like(p)),
    "new-dict": lambda opt, p: operator.setitem(opt.state, p, {}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit", STATE_EDITS)
def test_engine_follows_the_state_after_it_is_cleared_deleted_or_replaced(edit, device):
    """The loop reads the optimizer's state at each step; the engine steps what is there too, not its old buffers."""
    name = "emb.layers.2.bias" if edit in ("del-adam", "new-dict") else "fit.layers.0.matrix"

    def script(step, params, opt):
        if step == 2:
            STATE_EDITS[edit](opt, params[name])

    # 7 steps: the engine rebuilt at step 2, then on a GPU two eager steps and captured ones
    moved, params, opt = _scripted_run("engine", script, device, steps=7)
    ref, _, loop = _scripted_run("loop", script, device, steps=7)
    _assert_close_to_the_loop(moved, ref, _routes(opt, params))
    _assert_state_is_the_loops(opt, loop, params)
    row = opt.execution_table()[0]
    assert row["implementation"] == "engine" and row["cuda_graph"] == (device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_steps_the_engine_cannot_take_run_the_loop_and_are_reported_so(device):
    """A float64 matrix mixes the group's dtypes for two steps: the loop takes them, and execution_table says so.

    The engine takes the group again once its dtypes agree.
    """
    name = "fit.layers.1.matrix"
    reported = []  # execution_table before each step: how the step before ran

    def script(step, params, opt):
        p = params[name]
        if step == 2:
            p.data, p.grad = p.data.double(), p.grad.double()
        if step == 4:
            p.data, p.grad = p.data.float(), p.grad.float()
        reported.append(opt.execution_table()[0]["implementation"])

    moved, params, opt = _scripted_run("engine", script, device, steps=7)
    assert reported == ["loop", "engine", "engine", "loop", "loop", "engine", "engine"]
    row = opt.execution_table()[0]
    assert row["implementation"] == "engine" and row["cuda_graph"] == (device == "cuda")
    ref, _, loop = _scripted_run("loop", script, device, steps=7)
    _assert_close_to_the_loop(moved, ref, _routes(opt, params))
    _assert_state_is_the_loops(opt, loop, params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_momentum_keeps_its_dtype_when_the_parameters_change_theirs(dtype, device):
    """``p.data = p.data.to(dtype)`` after steps: each momentum keeps its dtype, with the engine as in the loop."""

    def script(step, params, opt):
        if step == 2:
            for p in params.values():
                p.data, p.grad = p.data.to(dtype), p.grad.to(dtype)

    moved, params, opt = _scripted_run("engine", script, device, steps=5)
    ref, _, loop = _scripted_run("loop", script, device, steps=5)
    # bfloat16 parameters on a GPU: the engine's two float32 steps differ from the loop's (Triton against
    # cuBLAS, within TORCH_MUON_TOL), so a later rounding of a stored 8-bit parameter (2^-9 of |p| ~ 1, a
    # third of a step here) can fall the other way in the two runs: 4.6 % of the movement on an H200. On the
    # CPU the two runs round alike. The momentum's dtype, this test's subject, is compared exactly below.
    muon_tol = 0.1 if (dtype == torch.bfloat16 and device == "cuda") else TORCH_MUON_TOL
    _assert_close_to_the_loop(moved, ref, _routes(opt, params), muon_tol)
    _assert_state_is_the_loops(opt, loop, params)  # the dtypes too: float32 momenta


@pytest.mark.parametrize("device", DEVICES)
def test_engine_follows_a_momentum_and_betas_schedule_without_rebuilding(device):
    # e.g. OneCycleLR, which cycles the "momentum" key of every group by default
    def script(step, params, opt):
        group = opt.param_groups[0]
        group["momentum"] = 0.85 + 0.02 * step
        group["adam_betas"] = (0.8 + 0.02 * step, 0.9 + 0.01 * step)

    moved, params, opt = _scripted_run("engine", script, device, steps=7)
    ref, _, _ = _scripted_run("loop", script, device, steps=7)
    _assert_close_to_the_loop(moved, ref, _routes(opt, params))
    # One engine for all steps: on a GPU its third step on was a replay of the captured graph.
    assert opt.execution_table()[0]["cuda_graph"] == (device == "cuda")


def test_engine_is_rebuilt_when_routing_changes_after_steps():
    """New names route a matrix to Adam: the rebuilt engine follows them, as the loop does."""

    def script(step, params, opt):
        if step == 2:
            opt.set_param_names(
                [(k.replace("fit.layers.1.matrix", "fit.layers.1.adam_matrix"), p) for k, p in params.items()]
            )

    moved, params, opt = _scripted_run("engine", script)
    ref, _, _ = _scripted_run("loop", script)
    assert _routes(opt, params)["fit.layers.1.matrix"] == "adam"
    # The renamed matrix keeps its Muon state and adds Adam state, in both implementations.
    _assert_close_to_the_loop(moved, ref, {**_routes(opt, params), "fit.layers.1.matrix": "muon"})


@pytest.mark.parametrize("device", DEVICES)
def test_a_rebuilt_engine_lets_the_old_buffers_go(device):
    """A change that rebuilds the engine frees the old engine's flat buffers: the optimizer never keeps two.

    The state's entries are views of the engine's flat buffers; a rebuild moves them into new ones, and
    the old buffer must then have no owner left (it held 12 MiB on DPA-3 water while it had one): freed at
    once by reference counting, not at some later garbage collection.
    """
    params = _params(torch.float32, device)
    opt = make_optimizer(list(params.values()), "engine", lr=1e-2, named_parameters=params.items())
    gen = torch.Generator().manual_seed(5)
    routes = _routes(opt, params)
    muon = next(p for name, p in params.items() if routes[name] == "muon")

    def step():
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()

    step()
    step()
    flat = weakref.ref(opt.state[muon]["momentum_buffer"]._base)  # the momentum of every Muon matrix
    assert flat() is not None
    opt.param_groups[0]["enable_gram"] = not opt.param_groups[0]["enable_gram"]  # fixed when an engine is built
    step()
    assert opt.state[muon]["momentum_buffer"]._base is not None  # the new engine's buffer
    assert flat() is None


def test_add_param_group_after_steps_rebuilds_the_engine():
    """The new group gets an engine of its own and steps as the loop does; the first group is unaffected."""
    runs = {}
    for implementation in ("engine", "loop"):
        params = _params(torch.float32, "cpu")
        extra = torch.nn.Parameter(torch.randn(12, 6, generator=torch.Generator().manual_seed(2)))
        start = {**{k: p.detach().clone() for k, p in params.items()}, "extra": extra.detach().clone()}
        opt = make_optimizer(list(params.values()), implementation, lr=1e-2, named_parameters=params.items())
        gen = torch.Generator().manual_seed(3)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": [extra], "lr": 1e-3})
            for p in [*params.values(), extra]:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        moved = {k: p.detach() - start[k] for k, p in {**params, "extra": extra}.items()}
        runs[implementation] = (moved, opt)
    (moved, opt), (ref, _) = runs["engine"], runs["loop"]
    assert [row["implementation"] for row in opt.execution_table()] == ["engine", "engine"]
    _assert_close_to_the_loop(moved, ref, {**_routes(opt, _params(torch.float32, "cpu")), "extra": "muon"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_matches_eager_steps_with_a_changing_lr():
    def run(implementation: str):
        params = _params(torch.float32, "cuda")
        opt = make_optimizer(list(params.values()), implementation, named_parameters=params.items())
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
        gen = torch.Generator().manual_seed(3)
        for _ in range(8):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen).cuda()
            opt.step()
            sched.step()
        return params, opt

    graphed, opt = run("engine")
    eager, _ = run("engine-eager")
    assert opt.execution_table()[0]["cuda_graph"], "no graph was captured"
    for name, p in graphed.items():
        # the same kernels on the same inputs: identical but for cuBLAS picking another
        # algorithm inside the capture, which moves a bf16 Newton-Schulz result by an ulp
        # (2**-8 relative); rtol=1e-2 leaves about 2.5 ulps for that ulp carried through steps
        torch.testing.assert_close(p, eager[name], rtol=1e-2, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_does_not_synchronise_inside_deepmds_device_context():
    """deepmd's trainer steps inside ``with torch.device(DEVICE)``; a step must not wait for the GPU there.

    torch's sync debug mode raises on any operation that synchronises the host with the GPU
    (a D2H copy, ``.item()``, a tensor built from host data on the device...).
    """
    from deepmd_hybridmuon import kernels

    shapes = dict(SHAPES, **{"fit.layers.3.matrix": (240, 240), "fit.layers.4.matrix": (136, 240)})
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.nn.Parameter(torch.randn(s, generator=gen).cuda()) for k, s in shapes.items()}
    opt = HybridMuonOptimizer(list(params.values()), named_parameters=params.items())
    grads = [[torch.randn(p.shape, generator=gen).cuda() for p in params.values()] for _ in range(3)]

    def step(k: int) -> None:
        for p, g in zip(params.values(), grads[k % 3], strict=True):
            p.grad = g
        with torch.device("cuda"):
            opt.step()

    step(0)
    assert kernels.wait_ready(600), "background compilation did not finish"
    for k in range(4):  # engine rebuilt with the kernels, eager steps, graph captured
        step(k)
    row = opt.execution_table()[0]
    assert row["cuda_graph"] and row["kernels"] == "triton", row
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(3):
            step(k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in params.values())


def test_step_leaves_a_device_context_but_keeps_other_torch_function_modes():
    """``step()`` runs outside deepmd's ``with torch.device(...)`` (a torch function mode that every
    torch call would pay for), with the same result; another mode on the stack (a user's) keeps it.
    """
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import DeviceContext

    class CountingDevice(DeviceContext):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountingDevice.calls += 1
            return super().__torch_function__(func, types, args, kwargs)

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    results = []
    for mode in (None, "device", "device+user"):
        params = _params(torch.float32, "cpu")
        opt = HybridMuonOptimizer(list(params.values()), named_parameters=params.items(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen)
            if mode is None:
                opt.step()
                continue
            with CountingDevice("cpu"):
                before = CountingDevice.calls
                if mode == "device":
                    opt.step()
                    # torch's step wrapper (no_grad, the profiler's record_function) calls a few torch
                    # functions before the step pops the mode; the step itself makes hundreds
                    assert CountingDevice.calls - before < 10, CountingDevice.calls - before
                else:
                    with Counting():
                        opt.step()
        if mode == "device+user":
            assert Counting.calls > 3 * 100, Counting.calls  # the user's mode saw every call of the steps
        results.append({n: p.detach().clone() for n, p in params.items()})
    for other in results[1:]:
        for name, value in results[0].items():
            assert torch.equal(other[name], value), name


@pytest.mark.parametrize("enable_gram", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_engine_feeds_newton_schulz_the_loops_nesterov_update_exactly(monkeypatch, dtype, enable_gram):
    # The momentum and its update are elementwise and rounded in the same dtypes as the loop's
    # (the Nesterov weight in float32, or float64, as torch reads the loop's Python float), so the
    # matrix handed to Newton-Schulz is the same to the bit once in the iteration's input dtype
    # (the engine's stacks hold it already); only Newton-Schulz's own rounding differs.
    fed: list[torch.Tensor] = []

    def recorded(fn):
        def record(x, *args, **kwargs):
            fed.append(x.detach().clone())
            return fn(x, *args, **kwargs)

        return record

    for name in ("newton_schulz", "gram_newton_schulz"):
        monkeypatch.setattr(F, name, recorded(getattr(F, name)))
    runs = {}
    for implementation in ("engine-eager", "loop"):
        fed.clear()
        w = torch.nn.Parameter(torch.randn(32, 48, generator=torch.Generator().manual_seed(0)).to(dtype))
        named = [("layers.0.matrix", w)]
        opt = make_optimizer([w], implementation, lr=1e-2, named_parameters=named, enable_gram=enable_gram)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            opt.param_groups[0]["momentum"] = 0.95 - 0.01 * step
            w.grad = torch.randn(w.shape, generator=gen).to(dtype)
            opt.step()
        runs[implementation] = list(fed)
    assert len(runs["engine-eager"]) == len(runs["loop"]) == 3
    for engine, loop in zip(runs["engine-eager"], runs["loop"], strict=True):
        assert torch.equal(engine, loop.reshape(engine.shape).to(engine.dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_take_the_decay_and_learning_rate_unrounded(dtype):
    """lr * weight_decay = 1 %: bfloat16 holds 1 - 0.01 as 0.98828 (17 % more decay) and lr = 0.05 as 0.050049.

    The engine must multiply by the numbers themselves (in float32, as the loop and the built-in do), not by their
    half-precision roundings: one step on a zero gradient (decay only) and one on a random one.
    """
    from deepmd.pt.optimizer.hybrid_muon import HybridMuonOptimizer as Builtin

    moved = {}
    for implementation in ("engine-eager", "loop", "builtin"):
        gen = torch.Generator().manual_seed(0)
        params = {
            "fit.matrix": torch.nn.Parameter(torch.randn(16, 24, generator=gen).to(dtype)),
            "fit.adamw_w": torch.nn.Parameter(torch.randn(4, 6, generator=gen).to(dtype)),
        }
        options = {"lr": 0.05, "weight_decay": 0.2, "named_parameters": params.items(), "enable_gram": False}
        if implementation == "builtin":
            opt = Builtin(list(params.values()), **options)
        else:
            opt = make_optimizer(list(params.values()), implementation, **options)
        start = {k: p.detach().clone() for k, p in params.items()}
        for step in range(2):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen).to(dtype) if step else torch.zeros_like(p)
            opt.step()
        moved[implementation] = {k: (p.detach() - start[k]).double() for k, p in params.items()}
    for k in moved["loop"]:
        # The loop and the engine run the same arithmetic: the same bits. The built-in's Newton-Schulz output is
        # scaled in bfloat16 before the update (tests/test_parity_builtin.py): a few half-precision roundings.
        torch.testing.assert_close(moved["engine-eager"][k], moved["loop"][k], rtol=0, atol=0, msg=k)
        err = float((moved["engine-eager"][k] - moved["builtin"][k]).norm() / moved["builtin"][k].norm())
        assert err < 0.02, (k, err)
