"""Run a GPU test tier from a cold start: ``quick`` (every kernel family plainly, every pair of options
once: tests/test_quick.py) or ``full`` (every other GPU test), spread over the machine's cores.

    PYTHONPATH=$PWD python3 tests/gpu/tier.py quick          # about 1 minute cold on the H200 machine
    PYTHONPATH=$PWD python3 tests/gpu/tier.py full           # the rest of the GPU suite, about 3 minutes
    PYTHONPATH=$PWD python3 tests/gpu/tier.py full --write-durations   # and refresh tests/gpu/durations.txt
    PYTHONPATH=$PWD python3 tests/gpu/tier.py quick -- -x    # arguments after -- go to pytest

A change that needs the full tier passes both: ``full`` leaves out what ``quick`` runs. Each
pytest-xdist worker compiles the specialisations its tests load on first use into CuPy's disk cache,
one compile per core side by side (compiling everything first, tests/gpu/warm.py, took longer than
the compiles the tests need). ``full`` starts the longest tests first, one per worker
(tests/gpu/durations.txt, ``--longest-first`` in tests/conftest.py), with work stealing for the
rest, and prints every test of 5 s or more; ``--write-durations`` writes them into durations.txt
(do so when they have moved). Every worker runs NumPy's BLAS on one thread: sixteen workers each
starting a thread per core only fight over the cores. The last lines printed are pytest's summary and
the tier's wall time, compile included.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIERS = {
    "quick": ["-m", "quick", "tests/test_quick.py"],
    "full": ["-m", "gpu", "tests", "--ignore=tests/test_compile.py", "--ignore=tests/test_quick.py",
             "--longest-first", "--dist", "worksteal", "--durations=0", "--durations-min=5"],
}
DURATIONS = ROOT / "tests" / "gpu" / "durations.txt"
# a line of pytest's "slowest durations" section: seconds, phase, test id
DURATION_LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tier", choices=TIERS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="pytest-xdist workers (default: every core)")
    parser.add_argument("--write-durations", action="store_true",
                        help="full: write the tests' seconds into tests/gpu/durations.txt")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args()
    env = dict(os.environ, **ONE_THREAD,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.time()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(args.jobs),
               *TIERS[args.tier], *args.pytest_args]
    lines = []
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) as run:
        for line in run.stdout:                       # shown as it comes, kept for the durations
            print(line, end="", flush=True)
            lines.append(line)
    print(f"{args.tier} tier: {time.time() - start:.0f} s wall, compile included", flush=True)
    if args.write_durations:
        seconds = seconds_of_tests(lines)
        DURATIONS.write_text(durations_text(seconds, DURATIONS.read_text()))
        print(f"wrote the seconds of {len(seconds)} tests into {DURATIONS.relative_to(ROOT)}", flush=True)
    return run.returncode


def seconds_of_tests(lines) -> dict:
    """{test id: seconds (setup, call and teardown summed)} from pytest's "slowest durations" section."""
    seconds, inside = {}, False
    for line in lines:
        if "slowest" in line and "durations" in line:
            inside = True
        elif inside and (match := DURATION_LINE.match(line)):
            seconds[match[3]] = seconds.get(match[3], 0.0) + float(match[1])
        elif inside and line.startswith("="):
            break
    return seconds


def durations_text(seconds: dict, old: str) -> str:
    """durations.txt with ``old``'s comment lines and ``seconds``, longest first."""
    comments = [line for line in old.splitlines() if line.startswith("#")]
    rows = [f"{s:.0f} {name}" for name, s in sorted(seconds.items(), key=lambda item: -item[1])]
    return "\n".join(comments + rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
