#!/usr/bin/env python3
"""The README's Quickstart, timed as a newcomer runs it, with the machine's load meanwhile.

The committed tree (``git archive HEAD``, what a clone holds) goes to a fresh folder, and the
Quickstart's commands run there verbatim, read from README.md, in one bash shell: the virtual
environment, the CPU-only torch line and the first command (install, data, training); with
``--tests`` the test command too. pip uses no cache and ignores this machine's pip configuration
(local indexes, wheel folders), as on a fresh machine; what it downloaded is the sum of the sizes
its "Downloading" lines give. Needs ``python3`` (the README's), ``git`` and network access to PyPI.

Usage::

    python3 benchmarks/quickstart.py benchmarks/results/quickstart/quickstart_<date>.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, command_line, parse_lcurve, parse_log, utc_now, write_json

TEST_COMMAND = 'pip install ".[test]" && python -m pytest'
#: What each timed piece of the first command is, by the command bash traces for it.
PIECES = {"pip install .": "install", "python make_data.py": "data", "dp --pt train input.json": "training"}
TRACE_RE = re.compile(r"^\++ (\d+\.\d+) (.*)$")
DOWNLOAD_RE = re.compile(r"Downloading \S+ \(([\d.]+) (kB|MB|GB)\)")
UNIT = {"kB": 1e3, "MB": 1e6, "GB": 1e9}


def readme_commands(readme: str) -> list[str]:
    """The command lines of the README's ``## Quickstart`` section, in order."""
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def size(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def durations(trace: str, end: float) -> tuple[list[float], dict[str, float]]:
    """Seconds of each README line (its ``: readme N`` marker to the next) and of each piece of ``PIECES``."""
    events = [(float(m.group(1)), m.group(2)) for m in map(TRACE_RE.match, trace.splitlines()) if m]
    events.append((end, ""))
    marks = [i for i, (_, cmd) in enumerate(events) if cmd.startswith(": readme ")] + [len(events) - 1]
    lines = [events[b][0] - events[a][0] for a, b in itertools.pairwise(marks)]
    pieces = {PIECES[cmd]: events[i + 1][0] - t for i, (t, cmd) in enumerate(events[:-1]) if cmd in PIECES}
    return lines, pieces


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the results file (JSON) to write")
    parser.add_argument("--tests", action="store_true", help="run the Quickstart's test command as well")
    parser.add_argument("--keep", action="store_true", help="keep the folder it ran in (its path is printed)")
    args = parser.parse_args(argv)
    commands = [c for c in readme_commands((REPO_ROOT / "README.md").read_text()) if args.tests or c != TEST_COMMAND]
    work = Path(tempfile.mkdtemp(prefix="quickstart-"))
    git = ["git", "-C", str(REPO_ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    tree = subprocess.run([*git, "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(work)], input=tree, check=True)
    script = "".join(f": readme {i}\n{c}\n" for i, c in enumerate(commands))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1")
    env.update({k: os.environ[k] for k in ("PIP_CERT",) if k in os.environ})  # the machine's TLS setup, if any
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(15):
            loads.append(os.getloadavg()[0])

    threading.Thread(target=sample, daemon=True).start()
    start_load, date = os.getloadavg(), utc_now()
    with open(work / "trace.txt", "w") as trace:
        proc = subprocess.run(
            ["bash", "-c", f"set -e\nBASH_XTRACEFD={trace.fileno()}\nPS4='+ $EPOCHREALTIME '\nset -x\n{script}"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            pass_fds=(trace.fileno(),),
        )
    end = time.time()
    done.set()
    log = proc.stdout + proc.stderr
    (work / "quickstart.log").write_text(log)
    lines, pieces = durations((work / "trace.txt").read_text(), end)
    lcurve = parse_lcurve(work / "examples" / "lcurve.out") or {}
    site = next((work / ".venv" / "lib").glob("python*/site-packages"), work / "missing")
    result = {
        "machine": f"{os.cpu_count()} CPU cores, no GPU ({os.uname().machine})",
        "date": date,
        "commit": commit,
        "command": command_line(),
        "returncode": proc.returncode,
        "commands": [{"command": c, "seconds": round(s, 1)} for c, s in zip(commands, lines, strict=False)],
        "seconds": {k: round(v, 1) for k, v in pieces.items()},
        "load_1min": {"start": start_load[0], "end": os.getloadavg()[0], "samples": loads},
        "average_s_per_batch": parse_log(log)["average_s_per_batch"],
        "lcurve": lcurve,
        "bytes": {
            "downloaded": round(sum(float(n) * UNIT[u] for n, u in DOWNLOAD_RE.findall(log))),
            "venv": size(work / ".venv"),
            "cuda": size(site / "nvidia"),
        },
        "last_lines": log.strip().splitlines()[-5:],
    }
    write_json(args.out, result)
    print(f"{args.out}: exit {proc.returncode}, {sum(lines):.0f} s; the folder {work}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
