"""Imported by deepmd-kit for entry-point group ``deepmd.pt_expt``; runs ``plugin.on_deepmd_pt_expt``."""

from deepmd_hybridmuon.plugin import on_deepmd_pt_expt

on_deepmd_pt_expt()
