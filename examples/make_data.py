#!/usr/bin/env python3
"""Generate a small two-species training set for the HybridMuon example.

The reference model is an analytic, smoothly truncated Morse pair potential
for a binary "A/B" alloy (energies in eV, lengths in Angstrom, masses in amu)::

    E = sum_{i<j} V_ab(r_ij) * s(r_ij)
    V_ab(r) = D_ab * [exp(-2 a_ab (r - r0_ab)) - 2 exp(-a_ab (r - r0_ab))]
    s(r) = 1 - 10 x^3 + 15 x^4 - 6 x^5,  x = (r - R_ON) / (R_CUT - R_ON) clipped to [0, 1]

so energy, force and force derivative all go to zero at R_CUT = 3.4 A, which
is below half of the cubic box (7.2 A) and below the descriptor cutoff used in
``input.json`` (3.5 A).  Minimum-image pair distances are therefore exact.

The system is 32 atoms (16 A + 16 B, randomly placed on a 2x2x2 fcc lattice,
number density ~0.085 A^-3, like a dense metal).  Frames are sampled from
Langevin (BAOAB) molecular dynamics at several temperatures, from a thermally
vibrating crystal up to a hot liquid, so forces and local environments vary a
lot.  Training and validation frames come from independent trajectories.

Output (deepmd/npy format, float64)::

    OUT/train/{type.raw, type_map.raw, set.000/{coord,box,energy,force}.npy}
    OUT/valid/...

Only numpy is needed.  Everything is seeded, so the output is reproducible.

Examples
--------
    python make_data.py                  # writes ./data/train and ./data/valid
    python make_data.py --check          # finite-difference check of the forces first
    python make_data.py --out more_data --ntrain 400 --nvalid 80
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

TYPE_MAP = ("A", "B")
MASSES = np.array([24.0, 40.0])  # amu
# Morse parameters, indexed [type_i, type_j]
D = np.array([[0.30, 0.40], [0.40, 0.20]])  # eV
ALPHA = np.array([[1.7, 1.6], [1.6, 1.5]])  # 1/A
R0 = np.array([[2.45, 2.55], [2.55, 2.70]])  # A
R_ON, R_CUT = 2.9, 3.4  # switching region, A

N_CELL = 2  # fcc cells per box edge -> 4 * N_CELL**3 = 32 atoms
LATTICE = 3.6  # fcc lattice constant, A (nearest neighbour 2.55 A)
BOX = N_CELL * LATTICE
KB = 8.617333262e-5  # eV/K
TIME_UNIT_FS = 10.1805055  # sqrt(amu * A^2 / eV) in fs

TEMPERATURES = (300.0, 900.0, 1800.0, 3000.0)  # K, frames are split evenly
DT_FS = 2.0
GAMMA_PER_FS = 0.01  # Langevin friction
N_EQUIL = 1000  # MD steps discarded per temperature
STRIDE = 25  # MD steps between saved frames


def energy_forces(pos: np.ndarray, types: np.ndarray, box: float) -> tuple[float, np.ndarray]:
    """Return total energy (eV) and forces (eV/A) of one periodic cubic frame."""
    d = pos[None, :, :] - pos[:, None, :]  # d[i, j] = r_j - r_i
    d -= box * np.round(d / box)
    r = np.sqrt(np.sum(d * d, axis=-1))
    n = len(pos)
    pair = (r < R_CUT) & ~np.eye(n, dtype=bool)
    ti, tj = np.meshgrid(types, types, indexing="ij")
    dd, aa, r0 = D[ti, tj], ALPHA[ti, tj], R0[ti, tj]
    rr = np.where(pair, r, R_CUT)
    e1 = np.exp(-aa * (rr - r0))
    v = dd * (e1 * e1 - 2.0 * e1)
    dv = 2.0 * aa * dd * (e1 - e1 * e1)
    x = np.clip((rr - R_ON) / (R_CUT - R_ON), 0.0, 1.0)
    s = 1.0 - x**3 * (10.0 - 15.0 * x + 6.0 * x * x)
    ds = -30.0 * x * x * (1.0 - x) ** 2 / (R_CUT - R_ON)
    e_pair = np.where(pair, v * s, 0.0)
    de_dr = np.where(pair, dv * s + v * ds, 0.0)
    # F_i = -dE/dr_i = sum_j dE/dr_ij * (r_j - r_i) / r_ij
    forces = np.sum((de_dr / np.where(pair, r, 1.0))[:, :, None] * d, axis=1)
    return 0.5 * float(np.sum(e_pair)), forces


def fcc_lattice() -> np.ndarray:
    """Cartesian positions of an N_CELL^3 fcc supercell."""
    basis = np.array([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.5]])
    cells = np.array([[i, j, k] for i in range(N_CELL) for j in range(N_CELL) for k in range(N_CELL)], dtype=float)
    return ((cells[:, None, :] + basis[None, :, :]).reshape(-1, 3)) * LATTICE


def langevin_frames(
    types: np.ndarray, temperature: float, nframes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample ``nframes`` frames from BAOAB Langevin dynamics at ``temperature``."""
    mass = MASSES[types][:, None]
    kt = KB * temperature
    dt = DT_FS / TIME_UNIT_FS
    c1 = np.exp(-GAMMA_PER_FS * DT_FS)
    c2 = np.sqrt((1.0 - c1 * c1) * kt / mass)
    pos = fcc_lattice() + rng.normal(scale=0.05, size=(len(types), 3))
    vel = rng.normal(size=pos.shape) * np.sqrt(kt / mass)
    _, f = energy_forces(pos, types, BOX)
    coords, energies, forces = [], [], []
    for step in range(N_EQUIL + nframes * STRIDE):
        vel += 0.5 * dt * f / mass
        pos += 0.5 * dt * vel
        vel = c1 * vel + c2 * rng.normal(size=pos.shape)
        pos += 0.5 * dt * vel
        pos %= BOX
        e, f = energy_forces(pos, types, BOX)
        vel += 0.5 * dt * f / mass
        if step >= N_EQUIL and (step - N_EQUIL + 1) % STRIDE == 0:
            coords.append(pos.copy())
            energies.append(e)
            forces.append(f.copy())
    return np.array(coords), np.array(energies), np.array(forces)


def make_system(types: np.ndarray, nframes: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Frames from all temperatures, evenly split, concatenated."""
    counts = np.full(len(TEMPERATURES), nframes // len(TEMPERATURES))
    counts[: nframes % len(TEMPERATURES)] += 1
    parts = [langevin_frames(types, t, int(c), rng) for t, c in zip(TEMPERATURES, counts, strict=True) if c > 0]
    coord = np.concatenate([p[0] for p in parts]).reshape(nframes, -1)
    return {
        "coord": coord,
        "box": np.tile(np.eye(3).reshape(1, 9) * BOX, (nframes, 1)),
        "energy": np.concatenate([p[1] for p in parts]),
        "force": np.concatenate([p[2] for p in parts]).reshape(nframes, -1),
    }


def write_system(path: Path, types: np.ndarray, data: dict[str, np.ndarray]) -> None:
    """Write one deepmd/npy system with a single set.000."""
    (path / "set.000").mkdir(parents=True, exist_ok=True)
    np.savetxt(path / "type.raw", types, fmt="%d")
    (path / "type_map.raw").write_text("\n".join(TYPE_MAP) + "\n")
    for key, value in data.items():
        np.save(path / "set.000" / f"{key}.npy", value.astype(np.float64))


def max_neighbours(types: np.ndarray, coord: np.ndarray, rcut: float) -> list[int]:
    """Largest number of neighbours of each type within ``rcut`` over all frames."""
    best = [0] * len(TYPE_MAP)
    for frame in coord.reshape(len(coord), -1, 3):
        d = frame[None] - frame[:, None]
        d -= BOX * np.round(d / BOX)
        close = (np.sum(d * d, axis=-1) < rcut * rcut) & ~np.eye(len(frame), dtype=bool)
        for t in range(len(TYPE_MAP)):
            best[t] = max(best[t], int(close[:, types == t].sum(axis=1).max()))
    return best


def check_forces(types: np.ndarray, rng: np.random.Generator, h: float = 1e-5) -> float:
    """Largest |F - (-dE/dx)| over a few random frames, by central differences."""
    worst = 0.0
    for temperature in (300.0, 3000.0):
        coord, _, _ = langevin_frames(types, temperature, 2, rng)
        for pos in coord:
            _, f = energy_forces(pos, types, BOX)
            num = np.zeros_like(pos)
            for i in range(len(pos)):
                for k in range(3):
                    p, m = pos.copy(), pos.copy()
                    p[i, k] += h
                    m[i, k] -= h
                    num[i, k] = -(energy_forces(p, types, BOX)[0] - energy_forces(m, types, BOX)[0]) / (2 * h)
            worst = max(worst, float(np.abs(num - f).max()))
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "data",
        help="output folder; train/ and valid/ are written inside (default: data/ next to this script)",
    )
    parser.add_argument("--ntrain", type=int, default=200, help="training frames (default: 200)")
    parser.add_argument("--nvalid", type=int, default=40, help="validation frames (default: 40)")
    parser.add_argument("--seed", type=int, default=20240611, help="random seed (default: 20240611)")
    parser.add_argument("--check", action="store_true", help="verify forces = -dE/dx by finite differences first")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    n_atoms = 4 * N_CELL**3
    types = rng.permutation(np.arange(n_atoms) % len(TYPE_MAP))

    if args.check:
        err = check_forces(types, np.random.default_rng(args.seed + 1))
        print(f"finite-difference check: max |F - (-dE/dx)| = {err:.2e} eV/A")
        if err > 1e-6:
            raise SystemExit("force check FAILED")

    for name, nframes, seed in (("train", args.ntrain, args.seed + 2), ("valid", args.nvalid, args.seed + 3)):
        data = make_system(types, nframes, np.random.default_rng(seed))
        write_system(args.out / name, types, data)
        e = data["energy"] / n_atoms
        f = data["force"]
        nn = max_neighbours(types, data["coord"], 3.5)
        print(
            f"{name}: {nframes} frames x {n_atoms} atoms -> {args.out / name}\n"
            f"  E/atom {e.min():.3f} .. {e.max():.3f} eV (std {e.std():.3f}), "
            f"force std {f.std():.3f} eV/A, max |F| {np.abs(f).max():.2f} eV/A, "
            f"max neighbours (A, B) within 3.5 A: {nn}"
        )
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
