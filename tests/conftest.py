"""Shared fixtures: tiny real deepmd-kit PyTorch models and helpers to drive optimizers.

The three model configurations are shrunk copies of the ``model`` sections of
``examples/water/{se_e2_a,dpa2_small,dpa3}_water.json``: same descriptor type and
options (three-body repinit, res_residual repformer/repflow updates, resnet_dt fitting,
...), far fewer neurons, layers and neighbours. They keep every parameter kind deepmd
creates for these descriptors: weight matrices (square, tall, wide), vectors whose shape
has a size-1 dimension (``(1, n)`` embedding matrices, ``(n, 1)`` output layers), biases,
``idt`` timesteps, ``ParameterList`` residual scales (names ending in a digit) and the
size-0 ``compress_info`` / ``compress_data`` placeholders.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon.optimizer import IMPLEMENTATIONS

# deepmd's models, and the ``dp`` runs the tests start, run on the CPU also on a machine with a
# GPU, as on the CI: the distributed tests' gloo ranks and their single-process references
# compare CPU results, and the expected log lines are the CPU's. deepmd reads ``DEVICE`` once,
# when it is first imported (below, by the tests' models). The GPU tests put their own tensors
# on the GPU.
os.environ.setdefault("DEVICE", "cpu")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: The Triton kernels against the loop (Muon-routed tensors, relative change over a few steps).
#: Both round every product to 8 (bf16) or 11 (fp16) bits, in different summation orders; ten
#: (five) iterations amplify the difference of one rounding (2^-8 = 0.4 %) to at most about 2 %
#: of the update (measured <= 1.6 %; test_kernels.py).
KERNEL_MUON_TOL = 3e-2
#: In the warning of test_distributed's spawn when it runs its ranks again after one died by a signal.
RETRY_WARNING = "run once more"
#: What our plugin logs (once per run) when deepmd's trainer builds our optimizer.
OURS_LOG_LINE = "optimizer: deepmd-hybridmuon"

MODEL_NAMES: tuple[str, ...] = ("se_e2_a", "dpa2", "dpa3")
TYPE_MAP: list[str] = ["O", "H"]

_SE_E2_A: dict = {
    "type_map": TYPE_MAP,
    "descriptor": {
        "type": "se_e2_a",
        "sel": [4, 8],
        "rcut_smth": 0.5,
        "rcut": 4.0,
        "neuron": [4, 8],
        "resnet_dt": False,
        "axis_neuron": 2,
        "type_one_side": True,
        "seed": 1,
    },
    "fitting_net": {"neuron": [8, 8], "resnet_dt": True, "seed": 1},
}

_DPA2: dict = {
    "type_map": TYPE_MAP,
    "descriptor": {
        "type": "dpa2",
        "repinit": {
            "tebd_dim": 4,
            "rcut": 4.0,
            "rcut_smth": 0.5,
            "nsel": 8,
            "neuron": [4, 8],
            "axis_neuron": 2,
            "activation_function": "tanh",
            "three_body_sel": 4,
            "three_body_rcut": 3.0,
            "three_body_rcut_smth": 2.5,
            "use_three_body": True,
        },
        "repformer": {
            "rcut": 3.0,
            "rcut_smth": 2.5,
            "nsel": 4,
            "nlayers": 2,
            "g1_dim": 8,
            "g2_dim": 4,
            "attn2_hidden": 4,
            "attn2_nhead": 2,
            "attn1_hidden": 8,
            "attn1_nhead": 2,
            "axis_neuron": 2,
            "update_h2": False,
            "update_g1_has_conv": True,
            "update_g1_has_grrg": True,
            "update_g1_has_drrd": True,
            "update_g1_has_attn": False,
            "update_g2_has_g1g1": False,
            "update_g2_has_attn": False,
            "update_style": "res_residual",
            "update_residual": 0.01,
            "update_residual_init": "norm",
            "attn2_has_gate": True,
            "use_sqrt_nnei": True,
            "g1_out_conv": True,
            "g1_out_mlp": True,
        },
        "precision": "float64",
        "add_tebd_to_repinit_out": False,
        "seed": 1,
    },
    "fitting_net": {"neuron": [8, 8], "resnet_dt": True, "precision": "float64", "seed": 1},
}

_DPA3: dict = {
    "type_map": TYPE_MAP,
    "descriptor": {
        "type": "dpa3",
        "repflow": {
            "n_dim": 8,
            "e_dim": 6,
            "a_dim": 4,
            "nlayers": 2,
            "e_rcut": 4.0,
            "e_rcut_smth": 3.5,
            "e_sel": 8,
            "a_rcut": 3.0,
            "a_rcut_smth": 2.5,
            "a_sel": 4,
            "axis_neuron": 2,
            "fix_stat_std": 0.3,
            "a_compress_rate": 1,
            "a_compress_e_rate": 2,
            "a_compress_use_split": True,
            "update_angle": True,
            "smooth_edge_update": True,
            "edge_init_use_dist": True,
            "use_exp_switch": True,
            "update_style": "res_residual",
            "update_residual": 0.1,
            "update_residual_init": "const",
        },
        "activation_function": "silut:10.0",
        "use_tebd_bias": False,
        "precision": "float32",
        "concat_output_tebd": False,
        "seed": 1,
    },
    "fitting_net": {
        "neuron": [8, 8],
        "resnet_dt": True,
        "precision": "float32",
        "activation_function": "silut:10.0",
        "seed": 1,
    },
}

MODEL_CONFIGS: dict[str, dict] = {"se_e2_a": _SE_E2_A, "dpa2": _DPA2, "dpa3": _DPA3}


def model_config(name: str, precision: str | None = None) -> dict:
    """The ``model`` section of ``name``, normalised and checked by deepmd's argcheck.

    ``precision`` (``"float32"`` / ``"float64"``) overrides the descriptor's and the
    fitting net's precision.
    """
    from deepmd.utils.argcheck import model_args

    raw = copy.deepcopy(MODEL_CONFIGS[name])
    if precision is not None:
        raw["descriptor"]["precision"] = precision
        raw["fitting_net"]["precision"] = precision
    spec = model_args()
    normalized = spec.normalize_value(raw, trim_pattern="_*")
    spec.check_value(normalized, strict=True)
    return normalized


def build_model(name: str, precision: str | None = None) -> torch.nn.Module:
    """A fresh deepmd-kit PyTorch model (same seed, hence same initial weights, every call)."""
    from deepmd.pt.model.model import get_model

    return get_model(model_config(name, precision))


@functools.cache
def _cached_model(name: str) -> torch.nn.Module:
    return build_model(name)


def model_named_parameters(name: str) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` of the session-cached model ``name``.

    The parameters are shared by every caller: tests that step an optimizer must work
    on :func:`clone_named` copies.
    """
    return list(_cached_model(name).named_parameters())


def clone_named(named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    """Fresh leaf parameters with the same names, values, dtypes and ``requires_grad``."""
    return [(n, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)) for n, p in named]


def seeded_grads(params: list[torch.Tensor], step: int, seed: int = 1234) -> list[torch.Tensor]:
    """Deterministic random gradients for ``params`` at ``step`` (same call -> same tensors)."""
    gen = torch.Generator().manual_seed(seed + 7919 * step)
    # drawn on the CPU (the same numbers everywhere), then on the parameter's device: on a
    # GPU machine deepmd builds its models on CUDA
    return [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype).to(p.device) for p in params]


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Assign copies of ``grads`` to the ``.grad`` of the trainable ``params``."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone() if p.requires_grad else None


def run_steps(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range | list[int], seed: int = 1234
) -> None:
    """Step ``opt`` once per entry of ``steps`` with :func:`seeded_grads` of that step index."""
    for k in steps:
        set_grads(params, seeded_grads(params, k, seed))
        opt.step()


def make_optimizer(params: Any, implementation: str = "engine", **options: Any) -> HybridMuonOptimizer:
    """A :class:`HybridMuonOptimizer` whose steps run ``implementation`` (``optimizer.IMPLEMENTATIONS``).

    The implementation is no constructor option; this sets the optimizer's private switch,
    the one place where it is chosen.
    """
    opt = HybridMuonOptimizer(params, **options)
    use_implementation(opt, implementation)
    return opt


def use_implementation(opt: HybridMuonOptimizer, implementation: str) -> None:
    """Make ``opt`` run ``implementation`` from its next step on (``optimizer.IMPLEMENTATIONS``)."""
    assert implementation in IMPLEMENTATIONS, implementation
    opt._implementation = implementation


@pytest.fixture(scope="module")
def kernels() -> Iterator[tuple[Any, torch.device]]:
    """``deepmd_hybridmuon.kernels``, compiled (GPU) or interpreted (CPU); and the device.

    Without a GPU the kernels run under Triton's CPU interpreter, which must be switched on
    (``TRITON_INTERPRET=1``) before Triton is first imported: modules using this fixture
    re-run themselves in a subprocess with it set (see :func:`run_interpreted`). Two
    shortcomings of Triton 3.6's interpreter are worked around, in the tests only (the package
    itself keeps the torch path on the CPU, whatever ``TRITON_INTERPRET`` says):

    * it converts a loaded scalar used as a loop bound with ``int()`` of a one-element
      array, which NumPy >= 2.4 rejects: the conversion is patched to take the element;
    * it multiplies bfloat16 matrices wrongly (NumPy has no bfloat16): the standard
      iteration's workspace is float16 under the interpreter. The Gram iteration is float16
      anyway, so its arithmetic is the production one.
    """
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        from deepmd_hybridmuon import kernels as K

        mp = pytest.MonkeyPatch()
        mp.setattr(K.compile, "registry", K.KernelRegistry(background=False))  # the kernels from the first step on
        yield K, torch.device("cuda")
        mp.undo()
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU: these tests run on the CPU instead, in Triton's interpreter, from one test of this file")
    from deepmd_hybridmuon import kernels as K

    mp = interpreter_workarounds()
    yield K, torch.device("cpu")
    mp.undo()


def interpreter_workarounds() -> pytest.MonkeyPatch:
    """Patch the two shortcomings of Triton 3.6's interpreter (see :func:`kernels`); undo with ``.undo()``.

    Also for processes that a test spawns (the distributed tests' ranks), which do not run fixtures.
    """
    import triton.runtime.interpreter as interpreter

    from deepmd_hybridmuon import functional as F
    from deepmd_hybridmuon import kernels as K
    from deepmd_hybridmuon.engine import compilation

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    mp = pytest.MonkeyPatch()
    mp.setattr(interpreter, "_patch_lang_tensor", patch)
    mp.setattr(K.common, "STANDARD_WORK_DTYPE", torch.float16)
    mp.setattr(compilation, "INTERPRETER_ON_CPU", True)  # the package's kernels on the CPU, with these workarounds
    mp.setattr(F, "STANDARD_FORM_DEVICES", frozenset())  # the oracle computes the GPU's arithmetic, as the kernels do
    return mp


def run_interpreted(path: str, select: str) -> None:
    """Run the tests of ``path`` selected by ``select`` (``pytest -k``) in a subprocess under Triton's interpreter."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, "-k", select]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout, run.stdout[-2000:]  # not everything skipped
    if RETRY_WARNING in run.stdout:  # test_distributed's retry after an abort: its warning, up here
        import warnings

        warnings.warn(f"interpreted {select!r}: {run.stdout[-6000:]}", stacklevel=2)


@pytest.fixture(scope="session", autouse=True)
def _single_intra_op_thread() -> Iterator[None]:
    """Run torch on one intra-op thread for the whole session.

    Every matrix here is small (mostly under 64 x 64), so OpenMP fork/join dominates: on this
    2-core machine, with another process busy, a 8 x 16 bfloat16 ``bmm`` takes ~10 ms
    with two threads and ~7 us with one. One thread also fixes the reduction order, which
    keeps the bitwise assertions independent of the machine's load.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def named_params() -> Callable[[str], list[tuple[str, torch.nn.Parameter]]]:
    """``named_params(name)`` -> ``list[(name, Parameter)]`` of the cached model (do not step them)."""
    return model_named_parameters


@pytest.fixture(scope="session", params=MODEL_NAMES)
def model_name(request: pytest.FixtureRequest) -> str:
    """Each of the three descriptor families in turn."""
    return request.param


# ------------------------------------------------------------------ real `dp` runs


def make_example_data(root: Path, ntrain: int, nvalid: int) -> Path:
    """The bundled example's data (``examples/make_data.py``, species A/B) with fewer frames.

    Returns ``root / "data"``, holding ``train`` and ``valid`` deepmd/npy systems.
    """
    out = root / "data"
    cmd = [sys.executable, str(EXAMPLES / "make_data.py"), "--out", str(out)]
    subprocess.run([*cmd, "--ntrain", str(ntrain), "--nvalid", str(nvalid)], check=True, capture_output=True)
    return out


def multi_task_input(config: dict) -> dict:
    """A single-task input as a two-branch multi-task one: type_map and descriptor in shared_dict, a fitting each."""
    model = config.pop("model")
    branch = {"type_map": "type_map_all", "descriptor": "shared_descriptor", "fitting_net": model["fitting_net"]}
    config["model"] = {
        "shared_dict": {"type_map_all": model["type_map"], "shared_descriptor": model["descriptor"]},
        "model_dict": {"one": copy.deepcopy(branch), "two": copy.deepcopy(branch)},
    }
    config["loss_dict"] = {"one": config["loss"], "two": config.pop("loss")}
    training = config["training"]
    data = {"training_data": training.pop("training_data"), "validation_data": training.pop("validation_data")}
    training["model_prob"] = {"one": 1.0, "two": 1.0}
    training["data_dict"] = {"one": data, "two": copy.deepcopy(data)}
    return config


def run_dp(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run ``python -m deepmd *args`` in ``cwd``; assert it succeeds and return its log."""
    proc = subprocess.run(
        [sys.executable, "-m", "deepmd", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})},
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def read_lcurve(path: Path) -> np.ndarray:
    """The rows of a ``lcurve.out`` (one row per displayed step; column 0 is the step)."""
    return np.atleast_2d(np.loadtxt(path))
