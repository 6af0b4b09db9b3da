"""megarl: Megatron-based, exact RL post-training for LLMs (see README.md and ../shared/DESIGN.md)."""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Synchronous RL post-training on Megatron-core with exact speculative rollouts",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    # Versions are pinned in requirements.txt / constraints.txt (torch must stay the CPU 2.13.0
    # build here); these are the floors the code needs.
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "transformers>=4.46",
        "safetensors>=0.4",
        "PyYAML>=6.0",
        "tqdm>=4.66",
        "numpy",
    ],
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
