"""Run a test's script in a fresh interpreter: an exception inside MindSpore's grad can break the
executor for the rest of the process, so failure paths that go through backward run here."""
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PREAMBLE = (f"import sys\nsys.path.insert(0, {os.path.join(REPO, 'tests')!r})\n"
             "import mindspore as ms\n"
             "from mindformers_ac.mindspore_compat import synchronous_pynative\n"
             "synchronous_pynative()\n")


def run_isolated(body, cwd=REPO, timeout=300):
    """Run ``body`` (dedented) after MindSpore is made synchronous, with the repository and tests/
    importable and a minimal environment; returns the ``CompletedProcess`` (text stdout and stderr)."""
    return subprocess.run([sys.executable, "-c", _PREAMBLE + textwrap.dedent(body)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"})
