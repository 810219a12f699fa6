"""A longer fuzzing run than CI's: schemathesis against the server (tests/test_server_openapi.py) and Hypothesis over
the readers (tests/test_io_fuzz.py), with many more examples, unseeded.

    python benchmarks/fuzz_server.py [EXAMPLES]    # default 1000 per operation and phase
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def main(examples: int) -> int:
    environment = {**os.environ, "FUZZ_EXAMPLES": str(examples), "HYPOTHESIS_PROFILE": "long", "PYTHONPATH": str(ROOT)}
    tests = ["tests/test_server_openapi.py", "tests/test_io_fuzz.py"]
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:warnings", *tests]
    return subprocess.run(command, cwd=ROOT, env=environment, timeout=3 * 3600).returncode


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000))
