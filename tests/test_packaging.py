"""The package as a user installs it: the wheel holds every module and data file, and the installed copy runs.

The rest of the suite imports the checkout (pytest puts it first on the
path), so a folder left out of the wheel (no ``__init__.py``) or a data file
missing from ``package_data`` would pass everywhere else and fail on the
user's first command. These tests look at what ``pip`` builds and installs.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "mindformers_ac"
DIST = "mindformers-ac"
# the data files the code reads at run time, by their path in the package
READ_AT_RUN_TIME = {"mindformers_ac/harness/default_configs/default.yaml"}


def _source_files():
    """Every file of the package in the checkout, as a path relative to the repository (no caches)."""
    return {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}


def test_every_folder_with_python_files_is_a_package():
    # find_packages (setup.py) takes only folders with an __init__.py: any other is left out of the wheel
    folders = {pathlib.PurePosixPath(f).parent for f in _source_files() if f.endswith(".py")}
    missing = sorted(str(d) for d in folders if not (REPO / d / "__init__.py").is_file())
    assert missing == []
    assert READ_AT_RUN_TIME <= _source_files()


def test_the_wheel_holds_every_module_and_data_file(tmp_path):
    # built from a copy of what the wheel is made of, so the checkout gets no build/ or egg-info
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "setup.py", src)
    shutil.copy(REPO / "README.md", src)   # setup.py reads it as the long description
    shutil.copytree(PACKAGE, src / "mindformers_ac", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheels = list((tmp_path / "dist").glob("mindformers_ac-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    in_package = {n for n in names if n.startswith("mindformers_ac/")}
    assert sorted(_source_files() - in_package) == []   # every module and data file of the tree ...
    assert sorted(in_package - _source_files()) == []   # ... and nothing else
    assert READ_AT_RUN_TIME <= in_package
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mindformers-ac = mindformers_ac.harness.cli:main" in zipfile.ZipFile(wheels[0]).read(entry_points).decode()


def _outside_env():
    """The environment of a user's shell: nothing puts the checkout on the import path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# Run from a directory outside the checkout: what a user's ``python`` finds. (In this process the checkout is
# on sys.path, and the egg-info an editable install leaves there would pass for the installed distribution.)
WHERE = """
import importlib.metadata, json, os
try:
    dist = importlib.metadata.distribution("mindformers-ac")
except importlib.metadata.PackageNotFoundError:
    dist = None
import mindformers_ac.harness.cli as cli, mindformers_ac.planner as planner
print(json.dumps({"site": str(dist.locate_file("")) if dist else None,
                  "direct_url": json.loads(dist.read_text("direct_url.json") or "{}") if dist else None,
                  "modules": [cli.__file__, planner.__file__],
                  "default_config": os.path.isfile(cli.default_config_path())}))
"""


@pytest.mark.slow
def test_the_installed_package_runs_from_another_directory(tmp_path):
    where = subprocess.run([sys.executable, "-c", WHERE], cwd=tmp_path, env=_outside_env(),
                           capture_output=True, text=True, timeout=300)
    if where.returncode != 0 and "No module named 'mindformers_ac'" in where.stderr:
        pytest.skip(f"{DIST} is not installed in this environment (pip install .)")
    assert where.returncode == 0, where.stderr[-3000:]
    found = json.loads(where.stdout.strip().splitlines()[-1])
    assert found["site"] is not None, "mindformers_ac imports, but no mindformers-ac distribution is installed"
    assert found["default_config"]
    script = pathlib.Path(sysconfig.get_path("scripts")) / "mindformers-ac"
    assert script.is_file(), f"{script}: pip installed no console script"
    help_run = subprocess.run([str(script), "--help"], cwd=tmp_path, env=_outside_env(),
                              capture_output=True, text=True, timeout=300)
    assert help_run.returncode == 0, help_run.stderr[-3000:]
    assert all(command in help_run.stdout for command in ("train", "validate", "explain", "plan"))
    files = [pathlib.Path(f).resolve() for f in found["modules"]]
    site = pathlib.Path(found["site"]).resolve()
    direct = found["direct_url"]
    if not direct.get("dir_info", {}).get("editable", False):
        # a regular install: the modules are the copy pip put into site-packages, not the checkout's
        assert all(f.is_relative_to(site / "mindformers_ac") for f in files), (files, site)
        assert not any(f.is_relative_to(PACKAGE) for f in files), files
    else:
        # an editable install points into its source tree by design: all that can be asserted is that the
        # import works from elsewhere and resolves to that tree (the wheel test covers what pip would copy)
        source = pathlib.Path(direct["url"].removeprefix("file://")).resolve()
        assert all(f.is_relative_to(source / "mindformers_ac") for f in files), (files, source)


def test_ci_runs_the_readme_test_command_verbatim():
    """CI must run exactly what README's quick start tells a user to run (linter included)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = [line for line in readme.splitlines() if line.startswith('pip install ".[test]"')]
    assert commands == ['pip install ".[test]" && ruff check . && python -m pytest -q']
    assert commands[0] in (REPO / ".ci" / "run").read_text(encoding="utf-8")
