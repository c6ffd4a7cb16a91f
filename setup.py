"""Stable Diffusion training recipes on Composer + Streaming.

Dependencies are pinned in requirements.txt / requirements-lock.txt and installed by `make install`;
install_requires names the direct ones so `pip install -e .` elsewhere pulls a working set.
"""

from pathlib import Path

from setuptools import setup

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
    packages=["convert", "data", "models", "recipes"],
    py_modules=["train"],
    install_requires=requirements,
    extras_require={"laion": ["img2dataset==1.47.0"]},
    entry_points={"console_scripts": ["sd-convert=convert.__main__:main"]},
)
