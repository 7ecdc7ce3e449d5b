"""Imported by deepmd-kit for entry-point group ``deepmd.pt``; runs ``plugin.on_deepmd_pt``."""

from deepmd_hybridmuon.plugin import on_deepmd_pt

on_deepmd_pt()
