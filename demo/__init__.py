"""The `make demo` walk-through and its judging, apart from the library code a user forks.

run.py drives the stages (`python -m demo`), evaluate.py samples and judges a trained model, and
classifier.py is the pixel classifier that judges. They use every other package; none uses them.
"""

import compat.torchao  # noqa: F401  (first: quiets what importing torchao logs; compat/torchao.py)
