"""FLUX.2 (issue 50, draft, not registered): rectified-flow transformers on a decoder LLM's stacked hidden
states, over the 32-channel FLUX.2 VAE (family "flux2"; presets.py, NOTES.md)."""
