"""SD3's MMDiT: a rectified-flow transformer on two CLIPs and an optional T5 (family "mmdit")."""
