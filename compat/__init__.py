"""Every use of a library's private or internal API, one module per library.

Composer, mosaicml-streaming, torch, transformers and diffusers are pinned (requirements.txt); the
code below relies on names they do not promise to keep: underscore attributes and functions,
monkeypatches, and modules below each library's public package. Each module here names the version
it was written for and why each use is needed, and the rest of the project calls these small
functions and re-exports instead. An upgrade that breaks one shows up in tests/test_compat.py, one
line per broken symbol, rather than at a distance in a run.

This package is the bottom layer: every package may import it, and it imports none of ours.
"""
