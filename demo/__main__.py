"""`python -m demo [--quick]` (what `make demo` runs); the stages are in demo/run.py."""

from demo.run import main

if __name__ == "__main__":
    main()
