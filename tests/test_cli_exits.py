"""How `mindformers-ac` ends when it does not run to its verdict, as a user's shell sees it (subprocesses).

A status is part of the interface: `train`'s 0 means "bitwise equal", so no
other way out may end with 0, and none may leave a training process or
temporary files behind.
"""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from test_train import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWAP = "swap:\n  enable: true\n  layer_swap:\n    - layers: [0]\n"
EXITING = '''
import sys


def exits_zero():
    sys.exit(0)


def exits_with_message():
    sys.exit("no accelerator found")
'''


def cli(cwd, *args, env=None, **popen):
    env = dict(env or os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return [sys.executable, "-m", "mindformers_ac.harness.cli", *args], dict(cwd=cwd, env=env, **popen)


def run(cwd, *args, **kwargs):
    cmd, options = cli(cwd, *args, **kwargs)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **options)


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "exiting_factory.py").write_text(EXITING)
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "swap.yaml").write_text(SWAP)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("spec, message", [
    ("exiting_factory:exits_zero", "error: --model: exiting_factory:exits_zero() raised SystemExit: sys.exit(0) "
                                   "(at exiting_factory.py:6)"),
    ("exiting_factory:exits_with_message", "error: --model: exiting_factory:exits_with_message() raised "
                                           "SystemExit: sys.exit('no accelerator found') (at exiting_factory.py:10)"),
    ("exits_on_import:build", "error: --model: cannot import module 'exits_on_import': importing it raised "
                              "SystemExit: sys.exit(0) (at exits_on_import.py:2)"),
])
def test_a_factory_that_calls_sys_exit_is_a_model_error(workdir, spec, message):
    proc = run(workdir, "train", "swap.yaml", "--model", spec)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1] == message
    assert "Traceback" not in proc.stderr and "[baseline]" not in proc.stderr


@pytest.mark.slow
def test_a_report_path_that_cannot_be_written_is_refused_before_training(workdir):
    (workdir / "taken").write_text("a file, not a directory")
    proc = run(workdir, "train", *TINY, "--report", "taken")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --report: 'taken' is an existing file; --report takes a directory, where report.json and "
        "memory.png are written")
    assert "[baseline]" not in proc.stderr and "AcPlan" not in proc.stdout   # nothing trained
    assert (workdir / "taken").read_text() == "a file, not a directory"
    proc = run(workdir, "train", *TINY, "--report", "taken/out")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --report: cannot create the directory 'taken/out': Not a directory")
    assert "[baseline]" not in proc.stderr


def _worker_of(parent, timeout=240):
    """The ``--worker`` child process of ``train`` once it has started, waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert parent.poll() is None, "train ended before its worker started"
        for child in psutil.Process(parent.pid).children(recursive=True):
            try:
                if "--worker" in child.cmdline():
                    return child
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.2)
    raise AssertionError("no worker process started")


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_worker_and_removes_the_temporary_directory(workdir, sig, status):
    temp = workdir / "tmp"   # the system temp folder of this run, so no other run's directories are seen
    temp.mkdir()
    config = workdir / "swap.yaml"
    cmd, options = cli(workdir, "train", str(config), *TINY[:-2], "--steps", "100000",
                       env=dict(os.environ, TMPDIR=str(temp)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    with subprocess.Popen(cmd, **options) as parent:
        try:
            worker = _worker_of(parent)
            children = psutil.Process(parent.pid).children(recursive=True)
            assert [p.name for p in temp.iterdir()][0].startswith("mindformers-ac-")   # the run's directory
            parent.send_signal(sig)
            out, err = parent.communicate(timeout=120)
        finally:
            if parent.poll() is None:
                parent.kill()
    assert parent.returncode == status, err[-3000:]
    assert f"interrupted ({sig.name})" in err and "Traceback" not in err
    survivors = [p.pid for p in children + [worker] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert survivors == []
    assert list(temp.iterdir()) == []
