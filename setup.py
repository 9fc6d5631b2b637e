from setuptools import find_packages, setup

setup(
    name="mindformers-ac",
    version="0.1.0",
    description="Activation recompute and swap for MindSpore PyNative training, driven by MindFormers-style YAML.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["mindformers_ac", "mindformers_ac.*"]),
    package_data={"mindformers_ac": ["default_configs/*.yaml"]},
    install_requires=[
        "mindspore==2.10.0",
        # the mindspore 2.10 wheel is built against numpy 1.x: numpy 2 breaks its first op
        "numpy<2",
        "pyyaml",
        "regex",
        "psutil",
        "matplotlib",
    ],
    extras_require={"test": ["pytest", "hypothesis"]},
    entry_points={"console_scripts": ["mindformers-ac=mindformers_ac.cli:main"]},
)
