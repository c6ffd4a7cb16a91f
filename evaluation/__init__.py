"""Image metrics of a trained model: `python -m evaluation.evaluate` (FID, KID, CLIP score against a
reference set), the feature extractors it loads, and the metric arithmetic."""

import compat.torchao  # noqa: F401  (first: quiets what importing torchao logs; compat/torchao.py)
