"""FLUX.1: a rectified-flow transformer on T5 and CLIP's pooled output (family "flux")."""
