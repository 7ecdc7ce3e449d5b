"""The HybridMuon optimizer: validation, state, and the step.

The math lives in :mod:`deepmd_hybridmuon.functional`, the reference step of a group in
:mod:`deepmd_hybridmuon.loop`; this module decides which rule each parameter gets, keeps the
per-parameter state in the layout of deepmd-kit 3.2.0's built-in optimizer, checks every user
input (:mod:`deepmd_hybridmuon.validation`) and chooses, per group, how the step runs.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re
import textwrap
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

from . import distributed, loop
from . import functional as F
from .engine import GroupEngine, compilation
from .options import GROUP_KEYS, OPTIMIZER_KEYS, OPTION, SETTINGS, option_doc
from .state import check_sizes, check_state_dict, own_memory, saved_params
from .validation import (
    REMOVED_KEYS,
    check_gradients,
    check_names,
    check_option,
    check_parameters,
    check_removed,
    check_settings,
    revalidate,
    validate_group,
)

#: Under deepmd's logger, so that ``dp`` shows these lines (the name imports nothing).
log = logging.getLogger("deepmd.hybridmuon")

#: The log line once a group's flat engine runs the Triton kernels (benchmarks read it).
KERNELS_IN_USE_LOG = "Triton kernels in use from step %d of this run"
#: The log line of the first skipped steps (tests and benchmarks may read it).
SKIPPED_LOG = (
    "steps skipped: %d of the first %d param_group steps (a gradient was NaN or inf, or too large for the "
    "arithmetic); a skipped group keeps its parameters, moments and momentum. Logged once"
)
#: The settings and group keys a group's engine is built from (the options that take effect at "build").
_BUILD_SETTINGS: tuple[str, ...] = tuple(key for key in SETTINGS if OPTION[key].effect == "build")
_BUILD_GROUP_KEYS: tuple[str, ...] = tuple(key for key in GROUP_KEYS if OPTION[key].effect == "build")
#: The ways a param_group's step can run; all compute the same step. Not an option: the default is always right for
#: users. Tests and benchmarks pick one by setting the private attribute ``_implementation`` of an optimizer before its
#: first step (the only switch; :meth:`HybridMuonOptimizer._engine` reads it):
#:
#: * ``"engine"`` (default): the flat engine (:mod:`deepmd_hybridmuon.engine`), its arithmetic
#:   captured in a CUDA graph after two eager steps on CUDA;
#: * ``"engine-eager"``: the flat engine, every step eager;
#: * ``"loop"``: the per-parameter loop (:mod:`deepmd_hybridmuon.loop`), the specification.
IMPLEMENTATIONS: tuple[str, ...] = ("engine", "engine-eager", "loop")
#: Attributes that pickling keeps besides torch's (see ``HybridMuonOptimizer.__getstate__``), with the
#: values an object pickled without them (torch's own ``__getstate__``) gets: the constructor's defaults.
_PICKLED: dict[str, Any] = {
    **{key: OPTION[key].default for key in SETTINGS},
    "_implementation": "engine",  # see IMPLEMENTATIONS
    "_names_version": 0,  # bumped when names change: the flat engines rebuild
    "_state_version": 0,  # bumped when a state dict is loaded
    "_adam_limit_logged": False,  # _log_adam_limit's one line was written
    "_steps_taken": 0,  # by this object (the log says from which step the Triton kernels run)
}
#: State tensors kept in float32 whatever the parameter dtype (torch's load_state_dict
#: casts them to the parameter dtype; we cast them back).
_FLOAT32_STATE: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "magma_score")


class SkipCount:
    """Counts, on each device, the param_group steps the finite gate let through; logs the first skip once.

    A skipped step is decided on the device (``functional.finite_gate``), and reading that decision every step would
    make the host wait for the GPU. So each step adds its gates to a device counter (one small kernel per group), and
    now and then the counter is copied to pinned host memory without waiting: at the 1st, 2nd, 4th, ... step, then every
    :attr:`EVERY` steps (a copy costs the host three CUDA calls, a tenth of a small model's step). The host reads the
    copy once it has arrived (an event query, at the next step). A skip is therefore logged at most :attr:`EVERY` steps
    or so after it happened; one in the last steps of a run may go unlogged. On the CPU the count is read at once.
    """

    #: Steps between two reads of the counters, once the first steps (powers of two) are read.
    EVERY = 64

    def __init__(self) -> None:
        self.taken: dict[torch.device, torch.Tensor] = {}  # the gates added up, on each device
        self.expected: dict[torch.device, int] = {}  # the gates added, counted on the host
        self.host: dict[torch.device, torch.Tensor] = {}  # where the counters are copied
        self.copied: dict[torch.device, tuple[Any, int]] | None = None  # the copy in flight: (event, expected)
        self.logged = False
        self.steps = 0

    def count(self, gates: list[torch.Tensor]) -> None:
        """Add this step's gates (1.0 taken, 0.0 skipped) to the counters; log if a copy shows a skip."""
        if self.logged or self._read():  # the copy in flight first: a due step then finds none
            return
        for gate in gates:
            device = gate.device
            if device not in self.taken:
                self.taken[device] = torch.zeros((), dtype=torch.float64, device=device)
                self.host[device] = torch.zeros((), dtype=torch.float64, pin_memory=device.type == "cuda")
                self.expected[device] = 0
            self.taken[device].add_(gate)
            self.expected[device] += 1
        self.steps += 1
        due = self.steps & (self.steps - 1) == 0 or self.steps % self.EVERY == 0
        if self.copied is None and self.taken and (due or not any(d.type == "cuda" for d in self.taken)):
            self.copied = {}
            for device, taken in self.taken.items():
                cuda = device.type == "cuda"
                self.host[device].copy_(taken, non_blocking=cuda)
                event = torch.cuda.Event() if cuda else None
                if event is not None:
                    event.record(torch.cuda.current_stream(device))
                self.copied[device] = (event, self.expected[device])
            self._read()  # on the CPU, at once

    def _read(self) -> bool:
        """Read the copy in flight if it has arrived; log the first skip it shows. Whether it logged."""
        if self.copied is None or not all(e is None or e.query() for e, _ in self.copied.values()):
            return False
        skipped = sum(n - round(float(self.host[device])) for device, (_, n) in self.copied.items())
        total = sum(n for _, n in self.copied.values())
        self.copied = None
        if skipped:
            self.logged = True
            log.warning(SKIPPED_LOG, skipped, total)
        return self.logged


def _outside_device_context() -> contextlib.AbstractContextManager[Any]:
    """Leave a ``with torch.device(...)`` block (or ``torch.set_default_device``) for the step.

    deepmd's trainer calls ``step()`` inside ``with torch.device(DEVICE)``. That block is a torch function mode: every
    torch call and tensor attribute read from Python then goes through a Python method first (about 700 per FSDP2 step
    on DPA-2 small: 4 ms of host time per step on an H100 in ``dp``). Every tensor the step creates names its device, so
    the mode only costs time; it is popped for the step when it is the only mode (other modes, a user's, stay).
    """
    if _DeviceContext is not None:  # else another torch: keep the mode
        stack = _function_modes()
        if len(stack) == 1 and isinstance(stack[0], _DeviceContext):
            return _pop_function_mode()
    return contextlib.nullcontext()


try:  # torch's own names for its mode stack (bound here once: both modules are part of torch's import)
    from torch.overrides import _get_current_function_mode_stack as _function_modes
    from torch.overrides import _pop_mode_temporarily as _pop_function_mode
    from torch.utils._device import DeviceContext as _DeviceContext
except ImportError:
    _DeviceContext = None


class HybridMuonOptimizer(Optimizer):
    r"""Muon for weight matrices, Adam for everything else, routed by name and shape.

    A drop-in replacement of deepmd-kit 3.2.0's ``deepmd.pt.optimizer.HybridMuonOptimizer``: same constructor, defaults,
    routing, state keys and param_group keys, so a checkpoint of either optimizer resumes with the other.

    **Routing** (per parameter; see :func:`deepmd_hybridmuon.functional.route_parameter`). The *leaf* is the last
    dot-separated segment of the parameter name that is not all digits, lower-cased.

    1. leaf ``b``, containing ``bias``, or prefixed ``adam_`` -> Adam (no weight decay);
       leaf prefixed ``adamw_`` -> AdamW (decoupled weight decay);
    2. effective shape (size-1 dimensions dropped) of rank < 2 -> Adam;
    3. no matrix view in ``muon_mode`` -> AdamW. Views: ``"2d"`` rank 2 only;
       ``"flat"`` one ``(prod(shape[:-1]), shape[-1])`` matrix; ``"slice"`` a batch of
       the trailing ``(rows, cols)`` matrices;
    4. otherwise Muon on that view.

    **Muon** (per parameter with gradient :math:`g`, learning rate :math:`\eta`, weight
    decay :math:`\lambda`, momentum :math:`\beta`):

    .. math::

        \theta &\leftarrow \theta\,(1 - \eta\lambda) \\
        m &\leftarrow \beta m + (1-\beta) g, \qquad u = \beta m + (1-\beta) g \\
        O &= \mathrm{NS}(u) \quad\text{(per matrix of the view)} \\
        \theta &\leftarrow \theta - \eta\, s\, d \odot O

    * NS, standard path: bfloat16; :math:`X_0 = u/\|u\|_F` (wide orientation), then
      :math:`X \leftarrow aX + (bA + cA^2)X`, :math:`A = XX^\top`, 8 iterations with
      (3.4445, -4.7750, 2.0315) and 2 with (2, -1.5, 0.5).
    * NS, Gram path (``enable_gram`` and a non-square matrix): float32 normalisation,
      float16 iteration on the Gram matrix with the five Polar Express steps (safety
      factor 1.05), restarted before the third step. On the CPU (no fast float16 products)
      the same five polynomials in the standard form, float32. Square matrices take the
      standard path on every device, whatever ``enable_gram``.
    * :math:`s = c\sqrt{\max(m, n)}` with ``lr_adjust_coeff`` :math:`c` when
      ``lr_adjust <= 0``; :math:`s = \sqrt{\max(1, m/n)}` otherwise.
    * :math:`d` (Magma-lite, ``magma_muon``): per matrix, :math:`r =`
      clamp((sigmoid(cos(m, g)/2) - sigmoid(-1/2)) / (sigmoid(1/2) - sigmoid(-1/2)), 0, 1);
      score :math:`\sigma \leftarrow 0.9\sigma + 0.1 r` (from 0.5);
      :math:`d = 0.1 + 0.9\sigma`. Without Magma, :math:`d = 1`.

    **Adam / AdamW** (float32 moments, :math:`\epsilon = 10^{-20}`, learning rate
    :math:`\eta_a = \eta` if ``lr_adjust <= 0`` else :math:`\eta/` ``lr_adjust``):
    AdamW first decays :math:`\theta \leftarrow \theta(1 - \eta_a\lambda)`; then
    :math:`\theta \leftarrow \theta - \eta_a \hat m / (\sqrt{\hat v} + \epsilon)` with
    bias-corrected moments of betas ``adam_betas``.

    **State** (torch's names; deepmd-kit 3.2.0's layout): Muon ``momentum_buffer`` (gradient dtype) and ``magma_score``
    (float32, one per matrix); Adam ``exp_avg``, ``exp_avg_sq`` (float32), ``beta1_pow``, ``beta2_pow`` (Python floats).

    Differences from the built-in, all fixes: float64 models resume (moments are cast back to float32 after
    ``load_state_dict``); ``add_param_group`` works after the first step; every hyperparameter is validated here with a
    ``ValueError`` (a param_group key that names a setting otherwise, ``adam_lr`` or ``betas``, too:
    :data:`~deepmd_hybridmuon.validation.MISNAMED_KEYS`; another key unknown to HybridMuon and torch is kept and
    ignored, with one ``UserWarning``); size-0 parameters and those without a gradient (frozen ones) are skipped; no
    ``torch.compile`` (no seconds of compilation at the first step; ``torch.compile(optimizer.step)`` runs the step
    as it is) and no import-time side effects; a step whose gradients hold NaN or inf,
    or elements too large for the arithmetic (2^127 and more; 2^63 and more on an Adam route), is skipped (parameters,
    moments, momentum and Magma scores unchanged, decided on the device; see
    :func:`deepmd_hybridmuon.functional.finite_gate`); FSDP2 (DTensor) parameters work, each Muon matrix orthogonalised
    once, on one owner rank (:mod:`deepmd_hybridmuon.distributed`); under DDP every replica takes the whole step, as one
    process does.

    Implementations: the per-parameter loop (:mod:`deepmd_hybridmuon.loop`) is the specification; the flat
    engine (:mod:`deepmd_hybridmuon.engine`) computes the same step in batched kernels, with
    Triton kernels (:mod:`deepmd_hybridmuon.kernels`) on CUDA, replayed as a CUDA graph, and
    is tested against it (:data:`IMPLEMENTATIONS`; :meth:`execution_table` says which runs).

    Parameters
    ----------
    params
        Parameters or param_group dicts.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 5e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.001,
        adam_betas: tuple[float, float] = (0.9, 0.95),
        lr_adjust: float = 0.0,
        lr_adjust_coeff: float = 0.18,
        muon_mode: str = "slice",
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        enable_gram: bool = True,
        flash_muon: bool = True,
        magma_muon: bool = True,
        use_foreach: bool | None = None,
        *,
        nonfinite_across_ranks: bool = False,
        **removed: Any,
    ) -> None:
        check_removed(removed)
        if removed:
            raise TypeError(
                f"HybridMuonOptimizer.__init__() got an unexpected keyword argument {next(iter(removed))!r}"
            )
        arguments = locals()  # the keywords by name: the options' table names them
        for key in SETTINGS:
            check_option(OPTION[key], arguments[key])
        if use_foreach is not None and not isinstance(use_foreach, bool):
            raise ValueError(f"Invalid use_foreach: {use_foreach!r}; expected true, false or None")
        defaults = {key: arguments[key] for key in GROUP_KEYS}
        if isinstance(adam_betas, list):
            defaults["adam_betas"] = tuple(adam_betas)
        validate_group(defaults)  # fail on the argument, before any group; choices lower-cased
        for key, default in _PICKLED.items():  # the settings as given, the private attributes' defaults
            setattr(self, key, arguments.get(key, default))
        self._param_names: dict[int, str] = {}
        # One flat engine per param_group (on FSDP2's shards: distributed.ShardedEngine), rebuilt by _engine's rule.
        self._runners: dict[int, GroupEngine] = {}
        self._checked: dict[int, tuple] = {}  # each group's values as step() last validated them
        self._skips = SkipCount()
        super().__init__(params, defaults)
        if named_parameters is not None:
            self.set_param_names(named_parameters)
        # What a first step on the GPU would wait for starts here, off the training thread.
        for device in {p.device for g in self.param_groups for p in g["params"] if p.device.type == "cuda"}:
            compilation.prepare_device(device, flash_muon)

    # ------------------------------------------------------------------ setup

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param_group after validating its keys and values (also after steps).

        Keys of the constructor that are no group hyperparameters (``flash_muon``, ``use_foreach``,
        ``nonfinite_across_ranks``) are dropped: ``ZeroRedundancyOptimizer`` copies every constructor keyword into the
        groups it hands to its local optimizer. A value other than the optimizer's own is refused: it would not apply to
        the group (:func:`~.validation.check_settings`, also at ``step()``), and so is a removed option (``ddp_split``).
        Nothing is added when a check fails.
        """
        check_removed(param_group)
        check_settings(param_group, self._settings())
        param_group = {k: v for k, v in param_group.items() if k not in OPTIMIZER_KEYS}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            validate_group(group)
            check_parameters(group["params"], len(self.param_groups) - 1)
            check_names(group.get("param_names"), len(group["params"]), f"param_group {len(self.param_groups) - 1}")
        except ValueError:
            self.param_groups.pop()
            raise
        self._name_from_groups([group])

    def _settings(self) -> dict[str, Any]:
        """The settings of the whole optimizer (``flash_muon``, ...), by key."""
        return {key: getattr(self, key) for key in SETTINGS}

    def _name_from_groups(self, groups: list[dict[str, Any]]) -> None:
        """Name each parameter of ``groups`` that has no name by its group's ``param_names`` (torch's named parameters).

        ``HybridMuonOptimizer(model.named_parameters())`` and a state dict saved with names then route by them.
        """
        for group in groups:
            for n, p in zip(group.get("param_names") or [None] * len(group["params"]), group["params"], strict=True):
                if n is not None and id(p) not in self._param_names:
                    self._param_names[id(p)] = str(n)
                    self._names_version += 1

    def set_param_names(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Give parameters names for name-based routing (in place of those of ``param_groups``' ``param_names``).

        The names stay out of ``param_groups`` and the state dict, so checkpoints (and
        ZeRO-1's gathered state) do not carry the model's object graph.
        """
        self._param_names = {id(p): str(name) for name, p in named_parameters}
        self._names_version += 1

    def param_name(self, p: torch.Tensor) -> str | None:
        """The name given to ``p`` by :meth:`set_param_names` or its group's ``param_names``, or ``None``."""
        return self._param_names.get(id(p))

    def _describe(self, p: torch.Tensor) -> str:
        """A parameter for messages: its name, or its shape."""
        name = self.param_name(p)
        return repr(name) if name is not None else f"unnamed, shape {tuple(p.shape)}"

    def route_of(self, p: torch.Tensor, group: dict[str, Any]) -> F.ParamRoute:
        """Route of parameter ``p`` in ``group`` (recomputed on demand; it is cheap)."""
        return F.route_parameter(self.param_name(p), tuple(p.shape), group["muon_mode"])

    def routing_table(self) -> list[dict[str, Any]]:
        """One row per parameter: name, shape, route, matrix view and reason."""
        return [
            {"name": self.param_name(p), "shape": tuple(p.shape), "route": r.route, "view": r.view, "reason": r.reason}
            for group in self.param_groups
            for p in group["params"]
            for r in [self.route_of(p, group)]
        ]

    def state_routing_mismatches(self) -> list[str]:
        """Parameters whose saved state does not fit their current route, one line each.

        A Muon-routed parameter must not carry Adam moments and vice versa, and a Magma
        score must have one entry per matrix of the current view. Such state comes from a
        checkpoint written with other routing settings (e.g. another ``muon_mode``).
        """
        problems = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                route = self.route_of(p, group)
                name = self.param_name(p) or f"<unnamed {tuple(p.shape)}>"
                if route.route == "muon" and "exp_avg" in state:
                    problems.append(f"{name}: Adam state, but routed to Muon")
                elif route.route != "muon" and "momentum_buffer" in state:
                    problems.append(f"{name}: Muon state, but routed to {route.route}")
                elif (
                    route.view is not None and "magma_score" in state and state["magma_score"].numel() != route.view[0]
                ):
                    problems.append(
                        f"{name}: Magma score for {state['magma_score'].numel()} matrices, view has {route.view[0]}"
                    )
        return problems

    # -------------------------------------------------------------- checkpoint

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle``, ``copy.deepcopy`` and ``torch.save`` keep: torch's part, the settings and the names.

        torch's part is ``defaults``, ``state`` and ``param_groups`` (its hooks are dropped, as torch does). The caches
        of the step (the flat engines) are left out and rebuilt at the next step; the names given by
        :meth:`set_param_names` are kept by parameter position, since a copy has other parameter objects.
        """
        out = super().__getstate__()
        out.update({key: getattr(self, key) for key in _PICKLED})
        out["param_names"] = [self.param_name(p) for group in self.param_groups for p in group["params"]]
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore :meth:`__getstate__`'s output (or torch's own, with the constructor's defaults) and empty caches.

        torch's ``load_state_dict`` calls this too, with ``state`` and ``param_groups`` only: the
        settings and names this optimizer already has are kept then. torch adds
        ``differentiable`` to the defaults here; it is no HybridMuon key.
        """
        state = dict(state)
        names = state.pop("param_names", None)
        settings = {key: state.pop(key) for key in _PICKLED if key in state}
        for key in REMOVED_KEYS:  # pickles of versions that had the option
            state.pop(key, None)
        super().__setstate__(state)
        self.defaults.pop("differentiable", None)
        for key, default in _PICKLED.items():
            setattr(self, key, settings.get(key, getattr(self, key, default)))
        self._runners = {}  # rebuilt at the next step
        self._checked = {}
        if not hasattr(self, "_skips"):  # a copy counts its own skipped steps
            self._skips = SkipCount()
        if names is not None:
            params = [p for group in self.param_groups for p in group["params"]]
            self._param_names = {id(p): name for p, name in zip(params, names, strict=True) if name is not None}
        elif not hasattr(self, "_param_names"):
            self._param_names = {}

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"hybridmuon": {"version": ...}`` naming the writer.

        ``state`` and ``param_groups`` have deepmd-kit 3.2.0's layout; torch's
        ``load_state_dict`` (the built-in's too) ignores the extra top-level key.
        """
        from . import __version__

        out = super().state_dict()
        # The flat engine keeps state as views of shared buffers: save independent tensors
        # (a saved view would carry the whole buffer). Cloning everything also makes the
        # result a snapshot (torch's returns live references); tests/test_distributed.py relies on it.
        out["state"] = {
            k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
            for k, v in out["state"].items()
        }
        out["hybridmuon"] = {"version": __version__}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer or of deepmd-kit's built-in one.

        torch casts floating state to each parameter's dtype; the Adam moments and Magma scores are float32 again here,
        so float64 models resume, and a float16 or bfloat16 model's are taken from the saved tensors (the cast lost
        their bits: an ``exp_avg_sq`` above 65504 became inf). ``beta1_pow`` and ``beta2_pow`` saved as one-element
        tensors are read back as the Python floats the step uses.

        Everything is checked first (:func:`deepmd_hybridmuon.state.check_state_dict`): a state dict of another
        optimizer, group values the constructor would refuse, or state of the wrong keys, shape or dtype raise a
        ``ValueError`` and leave this optimizer as it was. An option the writer did not have (an older version, deepmd's
        built-in) takes its default. The hooks of ``register_load_state_dict_pre_hook`` run before the checks, once;
        those of ``register_load_state_dict_post_hook`` last, on the state as the step reads it (their edits stay).
        A parameter without a name takes the one its saved group's ``param_names`` gives it, and routes as it did.
        """
        hooks = self._optimizer_load_state_dict_pre_hooks
        post_hooks = self._optimizer_load_state_dict_post_hooks
        if hooks and isinstance(state_dict, Mapping):  # they adapt what was saved: as torch runs them, before checks
            state_dict = dict(state_dict)
            for hook in hooks.values():
                result = hook(self, state_dict)
                state_dict = state_dict if result is None else result
        checked = check_state_dict(state_dict, self.param_groups, self._describe)
        # the pre-hooks ran once, above; the post-hooks run below, on the state as the step reads it
        self._optimizer_load_state_dict_pre_hooks = self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            super().load_state_dict(checked)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        self._state_version += 1
        for group in self.param_groups:  # torch keeps a saved group's every key: ZeroRedundancyOptimizer's copies of
            for key in OPTIMIZER_KEYS & group.keys():  # the constructor's settings go, as add_param_group drops them
                del group[key]
        self._name_from_groups(self.param_groups)  # saved with names: a parameter without one routes as it did
        for i, p in saved_params(checked["param_groups"], self.param_groups).items():
            state, saved = self.state.get(p, {}), checked["state"].get(i, {})
            for key in ("beta1_pow", "beta2_pow"):  # floats, as the step reads them (the check allows a tensor)
                if isinstance(state.get(key), torch.Tensor):
                    state[key] = float(saved[key])
            for key in _FLOAT32_STATE:
                value = state.get(key)
                if not isinstance(value, torch.Tensor) or value.dtype == torch.float32:
                    continue
                if p.dtype.itemsize < 4:
                    value = saved[key].to(device=value.device, copy=True)
                state[key] = value.to(torch.float32)
        own_memory(self.state, [p for group in self.param_groups for p in group["params"]])
        for hook in post_hooks.values():
            hook(self)

    # -------------------------------------------------------------------- step

    @torch._disable_dynamo  # imports dynamo at the first call, as torch's optimizers do, not at ours' import
    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Perform one optimisation step; ``closure`` re-evaluates the loss if given.

        ``torch.compile`` runs it as it is (dynamo disabled): it batches its own work into few kernels,
        Triton's and CUDA graphs on a GPU, which tracing would rebuild at every change of a learning rate.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _outside_device_context():
            # What changed in each group since the last step, validated as the constructor does, before any
            # parameter changes.
            settings = self._settings()
            for index, group in enumerate(self.param_groups):
                try:
                    self._checked[index] = revalidate(group, self._checked.get(index), settings)
                except ValueError as err:
                    raise ValueError(f"{err} (in param_groups[{index}] at step(); nothing was changed)") from None
            check_gradients(self.param_groups)
            shared = self._gate_all_ranks() if self.nonfinite_across_ranks else None
            # Every group's engine or loop first (each checks its parameters' sizes): a bad group stops the
            # step before any other group has taken it.
            runners = [self._engine(index, group) for index, group in enumerate(self.param_groups)]
            gates = []
            for index, (group, runner) in enumerate(zip(self.param_groups, runners, strict=True)):
                agreed = None if shared is None else shared[index]
                if runner is None:
                    gates.append(loop.step_group(self.state, group, self.route_of, agreed))
                else:
                    gates.append(runner.step(group, agreed))
            if not self._adam_limit_logged:
                self._log_adam_limit(gates)
            self._skips.count([gate for gate in gates if gate is not None])
        self._steps_taken += 1
        return loss

    def _log_adam_limit(self, gates: list[torch.Tensor | None]) -> None:
        """One log line, the first time a step is skipped for an Adam gradient above ``ADAM_GRAD_LIMIT``.

        Looks at the groups whose step was just skipped (``gates``: each group's finite gate) on the CPU,
        where reading a gate costs nothing: a taken step pays nothing more. On a GPU reading one would
        make the host wait for the device every step, so there the step is skipped silently, as for a NaN.
        """
        for group, gate in zip(self.param_groups, gates, strict=True):
            if gate is None or gate.device.type != "cpu" or bool(gate):
                continue
            for p in group["params"]:
                grad = p.grad
                if grad is None or grad.device.type != "cpu" or distributed.is_dtensor(grad) or not grad.numel():
                    continue
                if self.route_of(p, group).route == "muon":
                    continue
                peak = float(F.peak(grad))
                if peak >= F.ADAM_GRAD_LIMIT and math.isfinite(peak):
                    self._skips.logged = True  # this line says why: the count's line would repeat it
                    log.warning(
                        "step skipped: the Adam-routed parameter %s has a gradient of magnitude %.3g, at or above "
                        "%.3g, whose square float32 moments cannot hold (logged once)",
                        self._describe(p),
                        peak,
                        F.ADAM_GRAD_LIMIT,
                    )
                    self._adam_limit_logged = True
                    return

    def _gate_all_ranks(self) -> torch.Tensor:
        """Each param_group's finite gate of this rank's gradients, all-reduced (minimum) over the default group.

        One entry per param_group, as one process gates each group alone: a non-finite gradient skips its
        group on every rank, and the other groups step. Called once per ``step()`` on every rank, with or
        without parameters or gradients here, so that the collectives of all ranks pair up.
        """
        import torch.distributed as dist

        gates: list[torch.Tensor | None] = []
        for g in self.param_groups:
            grads: dict[bool, list[torch.Tensor]] = {True: [], False: []}  # by "Adam-routed"
            for p in g["params"]:
                if p.grad is not None:
                    grads[self.route_of(p, g).route != "muon"].append(distributed.local_shard(p.grad))
            gates.append(F.finite_gate(grads[False], grads[True]) if grads[True] or grads[False] else None)
        params = [p for g in self.param_groups for p in g["params"]]
        joined = dist.is_available() and dist.is_initialized()  # a torch built without distributed has neither
        nccl = joined and dist.get_backend() == "nccl"
        device = params[0].device if params else torch.device("cuda" if nccl else "cpu")
        one = torch.ones((), dtype=torch.float32, device=device)
        ok = torch.stack([one if gate is None else gate.to(device) for gate in gates])
        if joined:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return ok

    def _engine_signature(self, group: dict[str, Any]) -> tuple[Any, ...]:
        """What a group's engine is built from (names, state, the "build" options); a change rebuilds it."""
        return (
            self._names_version,
            self._state_version,
            self._implementation,
            *[getattr(self, key) for key in _BUILD_SETTINGS],
            # a number as a float: a one-element tensor may change in place
            *[group[key] if isinstance(group[key], (bool, str)) else float(group[key]) for key in _BUILD_GROUP_KEYS],
            float(group["weight_decay"]) > 0,  # read each step, but the decay passes exist or not
        )

    def _engine(self, index: int, group: dict[str, Any]) -> GroupEngine | None:
        """The flat engine of a group, (re)built when needed; ``None`` for the loop.

        The loop runs when :data:`IMPLEMENTATIONS` ``"loop"`` is chosen and for a group the
        engine does not support (mixed dtypes or devices, a momentum in another dtype than its
        parameter's: :meth:`GroupEngine.supports`). A group of FSDP2's DTensors always takes
        ``distributed.ShardedEngine`` (the loop cannot step shards). The engine holds the parameters
        with a gradient or state; one without a gradient in a step keeps its value and state there
        (a multi-task model's other branches), and one that gets its first gradient rebuilds it, as
        does a change of the state it was built with (:meth:`GroupEngine.matches`); FSDP2's engine is
        rebuilt whenever the set of parameters with a gradient changes. The parameters' sizes are
        checked when an engine is built, and at every step of the loop.
        """
        if self._implementation not in IMPLEMENTATIONS:
            raise ValueError(f"Invalid _implementation: {self._implementation!r}; expected one of {IMPLEMENTATIONS}")
        engine = self._runners.get(index)
        signature = self._engine_signature(group)  # with the implementation: a loop group never has an engine
        if (
            engine is not None
            and engine.signature == signature
            and engine.matches(group, self.state)
            and not engine.outdated
        ):
            return engine
        sharded = any(distributed.is_dtensor(p) for p in group["params"])
        kind = distributed.ShardedEngine if sharded else GroupEngine
        use_loop = (self._implementation == "loop" and not sharded) or not kind.supports(group, self.state)
        check_sizes(self.state, group["params"], self._describe)
        kernels_ready = engine is not None and engine.outdated
        # the old engine goes, its buffers, stacks and graphs before the new ones exist (its state lives on in
        # self.state, released); also when the loop takes the step: execution_table reports a group's engine as what ran
        if engine is not None:
            engine.release()
        self._runners.pop(index, None)
        del engine
        if use_loop:
            return None
        engine = self._runners[index] = kind(
            group,
            [self.route_of(p, group) for p in group["params"]],
            self.state,
            signature=signature,
            flash_muon=self.flash_muon,
            shared_gate=self.nonfinite_across_ranks,
            cuda_graph=self._implementation == "engine",
        )
        if kernels_ready and engine.compiling is None:
            log.info(KERNELS_IN_USE_LOG, self._steps_taken)
        return engine

    def execution_table(self) -> list[dict[str, Any]]:
        """How steps run, one row per param_group, as of the last step.

        ``implementation``: ``"engine"`` (the flat engine), ``"fsdp2"`` (FSDP2 DTensor parameters: the owner computes,
        :mod:`deepmd_hybridmuon.distributed`) or ``"loop"`` (not stepped yet, the loop chosen, or a group the engine
        does not support). The engine and FSDP2 rows also give ``kernels`` (``"triton"``, ``"torch"``, or
        ``"compiling"``: torch until the Triton kernels are compiled; under FSDP2, the owners' Newton–Schulz),
        ``torch_matrices`` ((rows, cols) of each Muon parameter on the torch path; under FSDP2, of the shapes this rank
        orthogonalises) and ``cuda_graph`` (steps replay captured CUDA graphs; under FSDP2, graphs with the collectives
        between them); the engine's also ``program_matrices`` (how many Muon matrices run one Triton program each).
        """
        rows = []
        for index, group in enumerate(self.param_groups):
            runner = self._runners.get(index)
            if runner is not None and runner.signature == self._engine_signature(group):
                rows.append(runner.summary())
            elif any(distributed.is_dtensor(p) for p in group["params"]):  # FSDP2, not stepped yet
                rows.append({"implementation": "fsdp2", "kernels": "torch", "torch_matrices": [], "cuda_graph": False})
            else:
                rows.append({"implementation": "loop"})
        return rows


#: The docstring's text of the constructor's parameters that are no options.
_OTHER_PARAMETERS = {
    "named_parameters": "``(name, parameter)`` pairs for name-based routing (or call :meth:`set_param_names`).",
    "use_foreach": "Accepted (``True``, ``False`` or ``None``) and ignored: deepmd-kit's trainer passes it. "
    "The step always batches its work (the flat engine).",
    "removed": f"Options that were removed ({', '.join(f'``{key}``' for key in REMOVED_KEYS)}) raise a ``ValueError`` "
    "that says what to do (:data:`deepmd_hybridmuon.validation.REMOVED_KEYS`); other unknown keywords a ``TypeError``.",
}


def _parameters_doc(doc: str) -> str:
    """``doc``, whose last section is Parameters with ``params`` alone, with the other parameters in order.

    The options' entries are their rows' text (:func:`.options.option_doc`). The indentation is read from
    the ``params`` entry: Python 3.13 strips a docstring's common indentation when it compiles it.
    """
    indent = re.search(r"^( *)params$", doc, re.M).group(1)
    entries = []
    for parameter in list(inspect.signature(HybridMuonOptimizer).parameters.values())[1:]:
        name = parameter.name
        text = option_doc(OPTION[name]) if name in OPTION else _OTHER_PARAMETERS[name]
        if parameter.kind is parameter.KEYWORD_ONLY:
            text += " Keyword-only."
        pad = indent + "    "  # (not at hyphens: a wrapped "deepmd-kit" would read "deepmd- kit" joined)
        body = textwrap.fill(text, 100, initial_indent=pad, subsequent_indent=pad, break_on_hyphens=False)
        entries.append(f"{indent}{'**' if parameter.kind is parameter.VAR_KEYWORD else ''}{name}\n{body}\n")
    return doc.rstrip(" ") + "".join(entries)


if HybridMuonOptimizer.__doc__:  # None under ``python -OO``
    HybridMuonOptimizer.__doc__ = _parameters_doc(HybridMuonOptimizer.__doc__)
