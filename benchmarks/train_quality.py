#!/usr/bin/env python
"""Training quality of deepmd-hybridmuon vs deepmd-kit's built-in HybridMuon vs Adam(W) on DFT water.

Two subcommands, so that the training can run on a machine without matplotlib and the
plots can be made elsewhere:

``run``
    For each config × optimizer × seed, writes a modified copy of a shared deepmd input
    (absolute data paths, ``numb_steps``, ``disp_freq`` = steps/20, ``save_freq`` = steps, an
    exponential learning rate from ``start_lr`` to ``start_lr/30`` with ``decay_steps`` = steps/20,
    training and model seeds = the seed, ``numb_btch`` validation batches per lcurve point, no
    ``stat_file``: each run computes the data statistics itself, so all runs of a seed see the
    same batches) into ``WORKDIR/<config>/<optimizer>/seed<k>/``, runs
    ``dp --pt train input.json`` there (log in ``train.log``), then by default
    ``dp --pt test`` of the final checkpoint on the whole validation system (log in ``test.log``).
    After each run, everything (lcurve included) goes into one JSON file, so that partial
    results survive an interruption; a run whose input is unchanged and which already
    succeeded in that JSON is skipped (``--rerun`` to force), so an interrupted sweep resumes.

    Optimizers:

    * ``ours``: ``{"type": "HybridMuon", **hm_kw}`` with this package's plugin active (checked:
      the log line "optimizer: deepmd-hybridmuon" must appear);
    * ``builtin``: the same section with ``DEEPMD_HYBRIDMUON_DISABLE=1``, deepmd-kit's own
      HybridMuon (checked: that log line must not appear);
    * ``adam``: ``{"type": "Adam"}``, or the config's own section when that is AdamW (dpa3);
      without one for dpa3, ``{"type": "AdamW"}``.

``report``
    Reads one or more results JSON files, prints a markdown table per config and writes
    learning curves (validation force and energy RMSE vs step) as ``quality_<config>.png``.
    Inputs trained with ``loss_func: mae`` (DPA-4's example) have ``mae_*`` lcurve columns and
    no ``rmse_*`` ones: their tables and plots show those, labelled MAE. Each table also gives
    the steps (and training seconds, steps x s/batch) each optimizer needs to reach the final
    validation force error of the best Adam(W) label.

The code: ``quality_run.py`` (run), ``quality_report.py`` (report), ``common.py`` (shared
with the other benchmarks); this file is the command line.

Units: deepmd's lcurve ``rmse_e_*`` is the energy RMSE divided by the number of atoms
(``rmse_e = sqrt(mean((E - E_ref)^2)) / natoms`` in ``deepmd/pt/loss/ener.py``), i.e. eV/atom;
``rmse_f_*`` is the force RMSE over all components, eV/Å. The tables show meV/atom and meV/Å.
The ``_val`` columns are evaluated on ``numb_btch`` batches of the validation system at each
lcurve point, the ``_trn`` columns on the single training batch of that step.

Usage::

    # on the GPU machine (python3 with torch, deepmd-kit and this package)
    python3 benchmarks/train_quality.py run --workdir runs/tq --seeds 1,2
    python3 benchmarks/train_quality.py run --configs dpa3_water --steps dpa3_water=800 \\
        --optimizers ours,builtin --lr ours=2e-3,builtin=2e-3 --hm-kw enable_gram=False --tag nogram
    # smoke test (CPU)
    python benchmarks/train_quality.py run --configs se_e2_a_water --steps se_e2_a_water=20 --seeds 1
    # here (needs matplotlib)
    python benchmarks/train_quality.py report runs/tq/results.json --plots plots/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONFIG_DIR
from quality_report import cmd_report
from quality_run import DEFAULT_CONFIGS, DEFAULT_LR, DEFAULT_STEPS, OPTIMIZERS, cmd_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="train and record results (no matplotlib needed)")
    r.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR, help=f"default {DEFAULT_CONFIG_DIR}")
    r.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of config names or paths")
    r.add_argument(
        "--steps",
        default=None,
        help="N for all, or per config: se_e2_a_water=2000,dpa3_water=800 "
        f"(defaults {', '.join(f'{k}={v}' for k, v in DEFAULT_STEPS.items())})",
    )
    r.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma list of: " + ",".join(OPTIMIZERS))
    r.add_argument("--seeds", default="1,2", help="comma list of seeds (default 1,2)")
    r.add_argument(
        "--lr",
        default=None,
        help=f"start_lr for all, or per optimizer: ours=1e-3,builtin=1e-3,adam=1e-3 (default {DEFAULT_LR:g})",
    )
    r.add_argument(
        "--hm-kw",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra HybridMuon key for ours and builtin, or ours:KEY=VALUE for one (repeatable)",
    )
    r.add_argument("--tag", default="", help="suffix of the optimizer labels (e.g. for a --hm-kw variant)")
    r.add_argument(
        "--keep-lr-schedule",
        action="store_true",
        help="keep the config's learning_rate section (e.g. DPA-4's wsd), only start_lr/stop_lr scaled",
    )
    r.add_argument("--valid-batches", type=int, default=8, help="validation_data numb_btch (default 8)")
    r.add_argument("--workdir", type=Path, default=Path("train_quality_runs"), help="default ./train_quality_runs")
    r.add_argument("--json", type=Path, default=None, help="results file (default WORKDIR/results.json)")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds per dp process (default 3600)")
    r.add_argument("--no-test", action="store_true", help="skip dp test of the final checkpoint")
    r.add_argument("--test-frames", type=int, default=100000, help="dp test -n (default: all frames)")
    r.add_argument("--rerun", action="store_true", help="rerun runs already done with the same input")
    r.add_argument("--fresh", action="store_true", help="start a new results file instead of adding to it")
    r.add_argument("--dp", default=None, help="dp command (default: dp next to this Python, else python -m deepmd)")
    r.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="markdown tables and learning-curve PNGs from results files")
    p.add_argument("results", type=Path, nargs="+", help="results JSON files")
    p.add_argument("--plots", type=Path, default=None, help="write quality_<config>.png here")
    p.add_argument("--mean", action="store_true", help="plot one curve per label (mean over seeds, range shaded)")
    p.add_argument("--ymax", type=float, default=None, help="upper limit of the plots' error axes (meV)")
    p.set_defaults(func=cmd_report)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
