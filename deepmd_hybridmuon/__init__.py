"""deepmd-hybridmuon: a faster, safer HybridMuon optimizer for DeePMD-kit.

Importing this package imports torch and nothing of deepmd; the deepmd-kit seam
lives in :mod:`deepmd_hybridmuon.plugin` and is loaded by deepmd-kit's entry points.
"""

from importlib.metadata import PackageNotFoundError, version

from .optimizer import HybridMuonOptimizer

try:
    __version__ = version("deepmd-hybridmuon")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["HybridMuonOptimizer", "__version__"]
