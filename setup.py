from setuptools import find_packages, setup

#: The torch versions the suite passed on: 2.13.0 (what `make` installs and CI runs) and 2.15.0, the
#: newest on the package index (2026-12-05; 2.14 not run).
TORCH = "torch>=2.13.0,<=2.15.0"

setup(
    name="koala-ds",
    version="0.1.0",
    description=("Pipeline schedules as data: a DSL, a search, and adapters for DeepSpeed, Megatron-core and "
                 "torch.distributed.pipelining"),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["koala_ds", "koala_ds.*"]),
    package_data={"koala_ds": ["library/*.koala", "profiles/*.json"]},
    install_requires=["numpy"],
    extras_require={
        "deepspeed": [TORCH, "deepspeed==0.19.8"],
        "megatron": [TORCH, "megatron-core==0.16.1"],
        "torch": [TORCH],  # koala_ds.torch: torch.distributed.pipelining's runtime
        "torchtitan": ["torch==2.13.0", "torchtitan==0.3.0"],  # tested with 2.13 only; ~50 packages (docs/torch.md)
        "exact": ["ortools>=9.10"],
        "viz": ["matplotlib>=3.7"],
        "search": ["tqdm>=4.60"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "tqdm>=4.60", "matplotlib>=3.7",
                "ortools>=9.10", "ninja", "pytest-xdist>=3.5"],
    },
    entry_points={"console_scripts": ["koala=koala_ds.cli:main", "koala-run=koala_ds.runtime.torchrun:cli"]},
)
