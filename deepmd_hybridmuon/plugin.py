"""The deepmd-kit seam: with :mod:`.cli` (``dp check``), the only module that imports deepmd (inside functions).

deepmd-kit loads three entry-point groups, each pointing here:

* ``deepmd.backend`` (every ``dp`` command): :func:`on_deepmd_backend` checks the deepmd-kit
  version and puts our ``HybridMuon`` schema in place of the built-in one in
  ``deepmd.utils.argcheck.opt_args_plugin``; :func:`add_dp_check` gives ``dp`` its ``check``
  subcommand.
* ``deepmd.pt`` / ``deepmd.pt_expt`` (when a PyTorch backend is imported): register a
  post-import hook on ``deepmd.pt.train.training`` / ``deepmd.pt_expt.train.training``;
  when the module is imported, :func:`patch_trainer` wraps three methods of its ``Trainer``:

  - ``__init__`` keeps the input's ``optimizer`` section on the trainer;
  - ``_create_optimizer(optimizer_class, **kwargs)`` is where both trainers build their
    optimizer: when ``optimizer_class`` is the built-in ``HybridMuonOptimizer`` we build
    ours instead, with the trainer's keywords plus the keys of the section the trainer
    does not know (see :func:`optimizer_kwargs`), and log what we built;
  - ``_load_optimizer_state`` lets the input file's settings win over a checkpoint's.

Nothing here runs at import of :mod:`deepmd_hybridmuon`; the entry points run it.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import os
import sys
import types
import warnings
from collections import Counter
from collections.abc import Callable
from importlib.metadata import version as dist_version
from typing import Any

import torch

from . import __version__
from .optimizer import HybridMuonOptimizer
from .options import SETTINGS
from .schema import HYBRID_MUON_DOC, hybrid_muon_arguments
from .state import check_state_dict, written_by_hybridmuon
from .validation import GROUP_KEYS, resolve_legacy_keys

log = logging.getLogger("deepmd.hybridmuon")

#: deepmd-kit versions whose trainer seam this release was checked against.
SUPPORTED_DEEPMD: tuple[tuple[int, int], tuple[int, int]] = ((3, 2), (3, 3))
SUPPORTED_DEEPMD_TEXT = "deepmd-kit >=3.2.0,<3.3"
#: Trainer modules whose ``Trainer`` we patch.
TRAINER_MODULES: tuple[str, ...] = ("deepmd.pt.train.training", "deepmd.pt_expt.train.training")
DP_MAIN_MODULE = "deepmd.main"
#: Set this environment variable to a non-empty value other than "0" to keep deepmd-kit's built-in HybridMuon (e.g. to
#: compare both); the entry points then only make the trainer log that (:func:`disabled_notice`).
DISABLE_ENV = "DEEPMD_HYBRIDMUON_DISABLE"
_PATCHED = "_hybridmuon_patched"
_NOTICE = "_hybridmuon_disabled_notice"


class UnsupportedDeepmdError(RuntimeError):
    """The installed deepmd-kit does not have the seam this plugin was built for."""


# ----------------------------------------------------------------------------- version


def check_deepmd_version(installed: str | None = None) -> str:
    """Return the installed deepmd-kit version; raise if this plugin does not support it."""
    installed = installed or dist_version("deepmd-kit")
    # the digits of the first two parts: "3.2.0rc1" -> (3, 2)
    major_minor = tuple(int("".join(filter(str.isdigit, part)) or 0) for part in installed.split(".")[:2])
    if not (SUPPORTED_DEEPMD[0] <= major_minor < SUPPORTED_DEEPMD[1]):
        raise UnsupportedDeepmdError(
            f"deepmd-hybridmuon {__version__} supports {SUPPORTED_DEEPMD_TEXT}, but deepmd-kit {installed} "
            "is installed. Install a supported deepmd-kit or uninstall deepmd-hybridmuon; it will not "
            "fall back to the built-in HybridMuon silently."
        )
    return installed


# ------------------------------------------------------------------------------ schema


def _plugin_registry() -> dict[tuple[str, Any, str], Callable[..., Any]]:
    from deepmd.utils import argcheck

    try:
        return argcheck.opt_args_plugin._ArgsPlugin__plugin.plugins
    except AttributeError as err:
        raise UnsupportedDeepmdError(
            f"deepmd.utils.argcheck.opt_args_plugin has no plugin registry; deepmd-hybridmuon "
            f"supports {SUPPORTED_DEEPMD_TEXT}."
        ) from err


def register_schema() -> None:
    """Replace the built-in ``HybridMuon`` entry of deepmd's optimizer schema with ours.

    The registry is a dict keyed by ``(name, alias, doc)``: a second ``HybridMuon`` key would make dargs fail with a
    duplicate, so the built-in key is swapped in place (keeping the order of the optimizer variants). Idempotent.
    """
    registry = _plugin_registry()
    if any(func is hybrid_muon_arguments for func in registry.values()):
        return
    items = list(registry.items())
    if not any(key[0] == "HybridMuon" for key, _ in items):
        raise UnsupportedDeepmdError(
            f"deepmd-kit has no built-in HybridMuon optimizer to replace; deepmd-hybridmuon supports "
            f"{SUPPORTED_DEEPMD_TEXT}."
        )
    registry.clear()
    for key, func in items:
        if key[0] == "HybridMuon":
            key, func = ("HybridMuon", key[1], HYBRID_MUON_DOC), hybrid_muon_arguments
        registry[key] = func


def train_input_arguments() -> list[Any]:
    """The whole ``dp train`` input schema with our optimizer registered.

    For ``dargs check -f deepmd_hybridmuon.plugin.train_input_arguments input.json``
    (no deepmd compat conversion there: use ``dp check`` for legacy inputs).
    """
    from deepmd.utils.argcheck import gen_args

    register_schema()
    return gen_args()


# ------------------------------------------------------------------------ the trainer


def optimizer_kwargs(section: dict[str, Any], trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Constructor keywords of our optimizer for one trainer.

    Starts from the keywords deepmd's trainer passes, maps the legacy keys of the input's ``optimizer`` section (with a
    DeprecationWarning) and adds every key of the section that our constructor takes and the trainer does not pass.
    """
    kwargs = dict(trainer_kwargs)
    resolved, messages = resolve_legacy_keys(section)
    for message in messages:
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        log.warning(message)
    if "muon_mode" in resolved and resolved.get("muon_mode") != section.get("muon_mode"):
        kwargs["muon_mode"] = resolved["muon_mode"]
    accepted = inspect.signature(HybridMuonOptimizer).parameters
    for key, value in resolved.items():
        if key in accepted and key not in kwargs and key not in ("params", "named_parameters"):
            kwargs[key] = value
    return kwargs


def routing_summary(optimizer: HybridMuonOptimizer) -> str:
    """One line: count and number of elements per route."""
    count: Counter[str] = Counter()
    numel: Counter[str] = Counter()
    for group in optimizer.param_groups:
        for p in group["params"]:
            route = optimizer.route_of(p, group).route
            count[route] += 1
            numel[route] += p.numel()
    return ", ".join(f"{r} {count[r]} tensors / {numel[r]:,} elements" for r in ("muon", "adam", "adamw"))


def _log_first_step(optimizer: HybridMuonOptimizer) -> None:
    """Log our INFO line (and the DEBUG routing table) at the first step, once the trainer has named the parameters."""

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        handle.remove()
        g = opt.param_groups[0]
        log.info(
            "optimizer: deepmd-hybridmuon %s HybridMuon (muon_mode=%s, enable_gram=%s, magma_muon=%s); routing: %s",
            __version__,
            g["muon_mode"],
            g["enable_gram"],
            g["magma_muon"],
            routing_summary(optimizer),
        )
        if log.isEnabledFor(logging.DEBUG):
            for row in optimizer.routing_table():
                log.debug("  %-70s %-18s %-5s view=%s", row["name"], row["shape"], row["route"], row["view"])

    handle = optimizer.register_step_pre_hook(hook)


def _local(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer doing this rank's update (ZeRO-1 wraps it in ``.optim``)."""
    return getattr(optimizer, "optim", optimizer)


def _input_wins(optimizer: torch.optim.Optimizer, before: list[dict[str, Any]]) -> None:
    """After a checkpoint's param_groups were loaded, restore the input's settings."""
    for group, wanted in zip(optimizer.param_groups, before, strict=False):
        for key, value in wanted.items():
            old = group.get(key)
            if old != value:
                log.info("restart: optimizer %s = %r from the input file (checkpoint had %r)", key, value, old)
                group[key] = value


def patch_trainer(module: Any) -> None:
    """Wrap ``module.Trainer`` so that it builds our optimizer for ``HybridMuon``. Idempotent.

    Raises
    ------
    UnsupportedDeepmdError
        If the trainer does not have the seam this plugin expects.
    """
    trainer = getattr(module, "Trainer", None)
    builtin = getattr(module, "HybridMuonOptimizer", None)
    create = getattr(trainer, "_create_optimizer", None)
    load = getattr(trainer, "_load_optimizer_state", None)
    if trainer is None or builtin is None or create is None or load is None:
        raise UnsupportedDeepmdError(
            f"{module.__name__}.Trainer does not have the optimizer seam deepmd-hybridmuon patches "
            f"(_create_optimizer, _load_optimizer_state, HybridMuonOptimizer); supported: {SUPPORTED_DEEPMD_TEXT}."
        )
    if getattr(trainer, _PATCHED, False):
        return
    if list(inspect.signature(create).parameters)[:2] != ["self", "optimizer_class"]:
        raise UnsupportedDeepmdError(
            f"{module.__name__}.Trainer._create_optimizer{inspect.signature(create)} is not the seam "
            f"deepmd-hybridmuon expects; supported: {SUPPORTED_DEEPMD_TEXT}."
        )
    original_init = trainer.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, config: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self._hybridmuon_section = dict(config.get("optimizer") or {})
        original_init(self, config, *args, **kwargs)

    @functools.wraps(create)
    def _create_optimizer(self: Any, optimizer_class: type, **kwargs: Any) -> torch.optim.Optimizer:
        if optimizer_class is not builtin and optimizer_class is not HybridMuonOptimizer:
            return create(self, optimizer_class, **kwargs)
        extra = optimizer_kwargs(getattr(self, "_hybridmuon_section", {}), kwargs)
        if getattr(getattr(self, "sharding", None), "stage", 0) == 1:
            # ZeRO-1: each rank's optimizer steps its own partition; ranks must agree on skipping a
            # step with a non-finite gradient. ZeroRedundancyOptimizer takes parameters_as_bucket_view
            # itself: each rank's parameters live in one flat bucket, and the step ends with one
            # broadcast per rank instead of one per parameter (BENCHMARKS.md, several GPUs).
            extra.update(nonfinite_across_ranks=True, parameters_as_bucket_view=True)
        optimizer = create(self, HybridMuonOptimizer, **extra)
        _log_first_step(_local(optimizer))  # type: ignore[arg-type]
        return optimizer

    @functools.wraps(load)
    def _load_optimizer_state(self: Any, *args: Any, **kwargs: Any) -> None:
        local = _local(self.optimizer)
        saved = args[0] if args else kwargs.get("optimizer_state_dict")
        ours = isinstance(local, HybridMuonOptimizer)
        written_by_ours = written_by_hybridmuon(saved)
        restart = getattr(self, "restart_training", True)
        if restart and written_by_ours is not None and written_by_ours != ours:
            # --restart from a checkpoint of another optimizer type: its state cannot drive this one
            # (AdamW has no momentum_buffer, HybridMuon no betas), so the optimizer starts afresh.
            log.warning(
                "restart: the checkpoint's optimizer state was written by %s and this input trains %s: the "
                "optimizer starts with fresh state (the weights and the step come from the checkpoint)",
                "HybridMuon" if written_by_ours else "another optimizer",
                type(local).__name__,
            )
            return None
        if not ours:
            return load(self, *args, **kwargs)
        zero = local is not self.optimizer
        if zero and saved is not None and restart:
            # ZeRO-1 copies the state into this rank's optimizer itself, past our load_state_dict's checks and
            # reading: the same first, against every parameter (ZeRO's own param_groups); it loads what they read.
            saved = check_state_dict(saved, self.optimizer.param_groups, local._describe)
        before = [{k: g[k] for k in GROUP_KEYS if k != "lr"} for g in local.param_groups]
        load(self, saved)
        _input_wins(local, before)
        if zero:  # ZeRO-1's step copies its own groups (the checkpoint's) into this rank's optimizer
            settings = {key: getattr(local, key) for key in SETTINGS}  # the input's (step() refuses others)
            for outer, inner, wanted in zip(self.optimizer.param_groups, local.param_groups, before, strict=True):
                outer.update({key: inner[key] for key in wanted})
                outer.update({key: value for key, value in settings.items() if key in outer})
        problems = local.state_routing_mismatches()
        if problems:
            raise RuntimeError(
                "the checkpoint's optimizer state does not match the routing of the input file's optimizer "
                f"settings ({len(problems)} parameters):\n  " + "\n  ".join(problems[:20]) + "\nUse the "
                "checkpoint's muon_mode, or start the optimizer afresh with `dp --pt train --init-model` "
                "(weights only) instead of --restart."
            )
        return None

    trainer.__init__ = __init__
    trainer._create_optimizer = _create_optimizer
    trainer._load_optimizer_state = _load_optimizer_state
    setattr(trainer, _PATCHED, True)


# --------------------------------------------------------------------------- dp check


def add_dp_check(module: types.ModuleType | None = None) -> None:
    """Give deepmd-kit's ``dp`` a ``check`` subcommand: ``dp [--pt | --pt-expt] check input.json``.

    ``dp`` has no hook for new subcommands, so this relies on the shape of ``deepmd.main`` (deepmd-kit 3.2) and
    changes none of deepmd-kit's files: ``dp``'s console script imports ``deepmd.main`` and then reads its
    ``main``; importing ``deepmd.main`` imports ``deepmd.backend``, which runs this function (entry point group
    ``deepmd.backend``) while ``deepmd.main`` is a plain module still being imported. Once imported, it has
    ``main(args=None)`` and ``main_parser()``, whose ``argparse`` parser has one subparsers action ``"command"``.

    The module's class becomes :class:`_DpMainModule`, whose ``main`` attribute is deepmd's ``main`` wrapped by
    :func:`_dp_main`: a ``check`` command line, or one without a command (``dp``, ``dp -h``), is parsed by
    deepmd's parser with our ``check`` subparser added; every other one goes to deepmd's ``main`` as it is. The
    module's own code reads its globals, not the attribute, and is unchanged. Any other shape (``deepmd.main``
    absent, not a plain module, no ``main`` or ``main_parser``, no such subparsers action) leaves ``dp``
    deepmd's own, and a DEBUG line on ``deepmd.hybridmuon`` says why. Idempotent.

    Parameters
    ----------
    module
        The module to change; ``sys.modules["deepmd.main"]`` by default.
    """
    module = sys.modules.get(DP_MAIN_MODULE) if module is None else module
    if module is None:
        log.debug("dp check not added: %s is not being imported (dp's entry point imports it first)", DP_MAIN_MODULE)
        return
    if isinstance(module, _DpMainModule):
        return
    if type(module) is not types.ModuleType:
        log.debug("dp check not added: %s is a %s, not a plain module", module.__name__, type(module).__name__)
        return
    module.__class__ = _DpMainModule


class _DpMainModule(types.ModuleType):
    """``deepmd.main`` whose ``main`` attribute knows ``check`` (see :func:`add_dp_check`)."""

    @property
    def main(self) -> Callable[..., Any]:
        """deepmd's ``main`` wrapped by :func:`_dp_main` (the same wrapper at every read)."""
        try:
            original = self.__dict__["main"]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute 'main'") from None
        wrapper = self.__dict__.get("_hybridmuon_main")
        if getattr(wrapper, "__wrapped__", None) is not original:
            wrapper = self.__dict__["_hybridmuon_main"] = _dp_main(self, original)
        return wrapper

    @main.setter
    def main(self, value: Callable[..., Any]) -> None:
        self.__dict__["main"] = value

    @main.deleter
    def main(self) -> None:
        del self.__dict__["main"]


def _dp_parser(module: types.ModuleType) -> Any:
    """dp's parser with ``check`` added, or ``None`` (logged at DEBUG) if it is not the expected shape."""
    from .cli import CHECK_DESCRIPTION, CHECK_HELP, add_check_arguments

    main_parser = module.__dict__.get("main_parser")
    if not callable(main_parser):
        log.debug("dp check not added: %s has no main_parser()", module.__name__)
        return None
    parser = main_parser()
    actions = [a for a in getattr(parser, "_actions", ()) if isinstance(a, argparse._SubParsersAction)]
    if not isinstance(parser, argparse.ArgumentParser) or len(actions) != 1 or actions[0].dest != "command":
        log.debug("dp check not added: %s.main_parser() has no subparsers action 'command'", module.__name__)
        return None
    if "check" in actions[0].choices:
        log.debug("dp check not added: dp already has a 'check' command")
        return None
    add_check_arguments(actions[0].add_parser("check", help=CHECK_HELP, description=CHECK_DESCRIPTION))
    return parser


def _dp_command(parser: Any, argv: list[str]) -> str | None:
    """The command word of dp's command line: the first argument that is not an option or an option's value.

    Follows argparse's reading of dp's top-level options: ``-b pt``, ``-bpt``, ``--backend pt``,
    ``--backend=pt`` and unambiguous prefixes of long options (``--back pt``).
    """
    options = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings}  # option -> takes a value
    words = iter(argv)
    for word in words:
        if word == "--":
            return next(words, None)
        if not word.startswith("-") or word == "-":
            return word
        if "=" in word:
            continue
        if word in options:
            matches = [word]
        elif word.startswith("--"):
            matches = [o for o in options if o.startswith(word)]
        else:
            matches = []  # -bpt: the value is attached
        if matches and all(options[o] for o in matches):
            next(words, None)
    return None


def _dp_main(module: types.ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    """deepmd's ``main`` with the ``check`` command added (see :func:`add_dp_check`)."""

    @functools.wraps(original)
    def main(args: list[str] | None = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            parser = _dp_parser(module)
            command = None if parser is None else _dp_command(parser, argv)
        except Exception as err:  # another deepmd-kit's parser: dp stays deepmd's own
            log.debug("dp check not added: reading dp's parser failed: %r", err)
            parser, command = None, None
        off = _disabled()  # dp is deepmd-kit's own, only its check says why there is none
        if parser is None or (off and command != "check"):
            return original(args)
        from .cli import legacy_conflicts, optimizer_error, run_check  # already imported by _dp_parser

        if command not in (None, "check"):
            # deepmd-kit's `dp train` lets dargs' error end the process in a traceback: an optimizer section
            # that fails our schema ends with dp check's message instead, exit 1.
            from dargs.dargs import ArgumentError

            def input_file() -> str | None:  # read when needed: other commands' lines stay deepmd's to refuse
                return getattr(parser.parse_known_args(argv)[0], "INPUT", None)

            if command == "train":  # deepmd-kit lets a contradicting legacy key win without a word
                for message in legacy_conflicts(input_file()):
                    log.warning(message)
            try:
                return original(args)
            except ArgumentError as err:
                message = optimizer_error(err, input_file())
                if message is None:
                    raise
                print(f"error: {message}", file=sys.stderr)
                raise SystemExit(1) from None
        if off:
            print(
                f"dp: error: no `check` command: deepmd-hybridmuon is off ({DISABLE_ENV}={os.environ[DISABLE_ENV]} "
                "in the environment). `dp-hybridmuon check` and `python -m deepmd_hybridmuon check` check an input "
                f"with deepmd-hybridmuon's schema all the same; unset {DISABLE_ENV} to train with it",
                file=sys.stderr,
            )
            raise SystemExit(2)
        parsed = parser.parse_args(argv)
        if parsed.command is None:  # `dp` alone: deepmd prints its help
            parser.print_help()
            return None
        status = run_check(parsed)
        if status:
            raise SystemExit(status)  # `python -m deepmd` ignores main's return value
        return None

    return main


# ------------------------------------------------------------------------ entry points


def disabled_notice(module: Any) -> None:
    """With :data:`DISABLE_ENV` set: ``module.Trainer`` logs that deepmd-kit's optimizer runs, and why.

    One line, when the first trainer is built (at import, before dp sets up its log, the
    line would be lost). Changes nothing else of the trainer. Idempotent.
    """
    trainer = getattr(module, "Trainer", None)
    if trainer is None or getattr(trainer, _NOTICE, False):
        return
    original_init = trainer.__init__
    said: list[bool] = []

    @functools.wraps(original_init)
    def __init__(self: Any, config: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if not said:
            said.append(True)
            log.info(
                "deepmd-hybridmuon is off (%s=%s in the environment): deepmd-kit's built-in %s optimizer runs",
                DISABLE_ENV,
                os.environ.get(DISABLE_ENV, ""),
                (config.get("optimizer") or {}).get("type", "default"),
            )
        original_init(self, config, *args, **kwargs)

    trainer.__init__ = __init__
    setattr(trainer, _NOTICE, True)


#: Values of :data:`DISABLE_ENV` that leave the plugin on (as unset does), any case.
ENABLED_VALUES: tuple[str, ...] = ("", "0", "false", "no", "off")


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ENABLED_VALUES


def _enable(trainer_module: str | None) -> None:
    """Version check and schema registration; then patch ``trainer_module`` when it is imported.

    With :data:`DISABLE_ENV` set, the trainer only gets :func:`disabled_notice`'s log line.
    """
    off = _disabled()
    if not off:
        check_deepmd_version()
        register_schema()
    if trainer_module is not None:
        import wrapt

        wrapt.register_post_import_hook(disabled_notice if off else patch_trainer, trainer_module)


def on_deepmd_backend() -> None:
    """Entry point of group ``deepmd.backend``: version check, schema registration, ``dp check``.

    With :data:`DISABLE_ENV` set, ``dp check`` only says why there is no check (every other command line is
    deepmd-kit's, ``dp -h`` too).
    """
    _enable(None)
    add_dp_check()


def on_deepmd_pt() -> None:
    """Entry point of group ``deepmd.pt``: also patch the PyTorch trainer when it is imported."""
    _enable(TRAINER_MODULES[0])


def on_deepmd_pt_expt() -> None:
    """Entry point of group ``deepmd.pt_expt``: also patch the pt_expt trainer when it is imported."""
    _enable(TRAINER_MODULES[1])
