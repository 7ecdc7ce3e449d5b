"""Imported by deepmd-kit for entry-point group ``deepmd.backend``; runs ``plugin.on_deepmd_backend``."""

from deepmd_hybridmuon.plugin import on_deepmd_backend

on_deepmd_backend()
