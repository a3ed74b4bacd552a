"""Build for megatron-paging. The CUDA extension is compiled on first use (JIT, cached)."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = {}
exec((here / "megatron_paging" / "version.py").read_text(), version)

setup(
    name="megatron-paging",
    version=version["__version__"],
    description="Paged MoE activation stashing for Megatron-Core: page-tile CUDA kernels and a "
    "FIFO paging-stream scheduler",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12,<3.13",
    packages=find_packages(include=["megatron_paging", "megatron_paging.*"]),
    package_data={"megatron_paging.kernels": ["csrc/*.cu", "csrc/*.cpp", "csrc/*.h", "csrc/*.cuh"]},
    install_requires=[
        "torch==2.11.0",
        f"megatron-core=={version['SUPPORTED_MEGATRON_CORE']}",
        "numpy",
        "matplotlib",
        "ninja",
        # Megatron-Core's torch_dist checkpoint writer imports it at save time, undeclared
        "psutil",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "ruff"],
        # Optional accelerators: detected at run time, never required.
        "te": ["transformer-engine"],
        "apex": ["apex"],
    },
    entry_points={"console_scripts": ["megatron-paging=megatron_paging.cli:main"]},
)
