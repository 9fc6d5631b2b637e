from setuptools import find_packages, setup

setup(
    name="mindformers-ac",
    version="0.1.0",
    description="Activation recompute and swap for MindSpore PyNative training, driven by MindFormers-style YAML.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["mindformers_ac", "mindformers_ac.*"]),
    package_data={"mindformers_ac.harness": ["default_configs/*.yaml"]},
    install_requires=[
        # 2.9.0 is the oldest release with what the engines need (mindformers_ac/mindspore_compat.py);
        # tested on 2.9.0 and 2.10.0. No upper pin below the next major: a newer MindSpore is not downgraded.
        "mindspore>=2.9.0,<3",
        # the mindspore 2.10 wheel is built against numpy 1.x: numpy 2 breaks its first op
        "numpy<2",
        "pyyaml",
        "regex",
        # the harness's: psutil for the msrun launcher (MindSpore imports it too), matplotlib for
        # train's memory.png; `import mindformers_ac` loads neither
        "psutil",
        "matplotlib",
    ],
    # setuptools and wheel: tests/test_packaging.py builds the wheel offline (--no-build-isolation);
    # pytest-xdist: the suite runs on three workers (pytest.ini)
    extras_require={"test": ["pytest", "pytest-xdist", "hypothesis", "setuptools", "wheel", "ruff"]},
    entry_points={"console_scripts": ["mindformers-ac=mindformers_ac.harness.cli:main"]},
)
