"""Packaging for the checkpointless recovery engine.

torch is deliberately required with a floor only: the Makefile installs the pinned CPU build
(``torch==2.13.0``) first, so this requirement is already satisfied and pip never reaches for a
CUDA build. On a GPU machine install the torch build that matches its CUDA first, then this.
"""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="p2p-state",
    version="0.1.0",
    description="Checkpointless, peer-to-peer recovery for PyTorch FSDP training",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["p2p_state*", "recovery*", "dataload*", "launcher*", "bench*"]),
    package_data={"bench": ["data/*.json"]},
    install_requires=[
        "torch>=2.6",
        "pyzmq>=25",
        "msgpack>=1.0",
        "numpy>=1.24",
        "xxhash>=3.0",
        # the coordinator's exhaustive match over decisions (typing has it from 3.11)
        "typing_extensions>=4.1; python_version < '3.11'",
    ],
    extras_require={
        "gpu": ["cupy-cuda12x>=13"],
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "hypothesis>=6.100",
            "ruff>=0.6",
            "mypy>=1.10",
            "moto[server]>=5.0",
            "s3fs>=2024.2",
        ],
        "bench": ["matplotlib>=3.8", "rich>=13"],
        "s3": ["fsspec>=2024.2", "s3fs>=2024.2"],
    },
    entry_points={
        "console_scripts": [
            "p2p-run=launcher.cli:main",
            "p2p-bench=bench.cli:main",
        ]
    },
)
