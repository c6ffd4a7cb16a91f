"""Stable Diffusion training recipes on Composer + Streaming.

Dependencies are pinned in requirements.txt (runtime) / requirements-dev.txt (plus test tools) /
requirements-lock.txt and installed by `make install`; install_requires names the direct runtime
ones so `pip install -e .` elsewhere pulls a working set without the test tools.
"""

from pathlib import Path

from setuptools import find_packages, setup

requirements = [
    line.split("#")[0].strip()
    for line in Path(__file__).with_name("requirements.txt").read_text().splitlines()
    if line.split("#")[0].strip()
]

setup(
    name="sd-recipes",
    version="0.1.0",
    description="Train Stable Diffusion with Composer and mosaicml-streaming, from 1 to 256 GPUs",
    python_requires=">=3.11,<3.12",
    # The top-level packages and every folder under them (models/engine, models/families/flux, ...).
    packages=find_packages(
        include=[
            f"{top}*"
            for top in (
                "common",
                "compat",
                "convert",
                "data",
                "demo",
                "evaluation",
                "extensions",
                "models",
                "recipes",
            )
        ]
    ),
    py_modules=["train"],
    install_requires=requirements,
    extras_require={"laion": ["img2dataset==1.47.0"]},
    entry_points={"console_scripts": ["sd-convert=convert.__main__:main"]},
)
