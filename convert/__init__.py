import compat.torchao  # noqa: F401  (first: quiets what importing torchao logs; compat/torchao.py)
