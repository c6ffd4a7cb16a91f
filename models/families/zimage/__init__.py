"""Z-Image: a single-stream rectified-flow transformer on a decoder LLM (family "zimage")."""
