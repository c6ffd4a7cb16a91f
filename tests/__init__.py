"""The test suite. A regular package (not a namespace one) because torch-fidelity 0.4.0 installs a
top-level `tests` package into site-packages, which would otherwise shadow this folder."""
