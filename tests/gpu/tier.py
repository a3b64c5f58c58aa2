"""Run a GPU test tier from a cold start: ``quick`` (every kernel family plainly, every pair of options
once: tests/test_quick.py) or ``full`` (every GPU test), spread over the machine's cores.

    PYTHONPATH=$PWD python3 tests/gpu/tier.py quick          # about 2.5 minutes cold on the H200 machine
    PYTHONPATH=$PWD python3 tests/gpu/tier.py full           # about 15 minutes cold (the goal is 9)
    PYTHONPATH=$PWD python3 tests/gpu/tier.py quick -- -x    # arguments after -- go to pytest

Each pytest-xdist worker compiles the specialisations its tests load on first use, so the compiles run
side by side, one per core; ``full`` first compiles every specialisation the suite loads
(tests/gpu/warm.py) in a pool of its own. The last lines printed are pytest's summary and the tier's
wall time, compile included.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIERS = {
    "quick": ["-m", "quick", "tests/test_quick.py"],
    "full": ["-m", "gpu", "tests", "--ignore=tests/test_compile.py"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tier", choices=TIERS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="pytest-xdist workers (default: every core)")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.time()
    if args.tier == "full":
        subprocess.run([sys.executable, "tests/gpu/warm.py", "--jobs", str(args.jobs)], cwd=ROOT, env=env, check=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(args.jobs),
               *TIERS[args.tier], *args.pytest_args]
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    print(f"{args.tier} tier: {time.time() - start:.0f} s wall, compile included", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
