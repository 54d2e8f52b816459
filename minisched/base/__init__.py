"""Layer 0: plain helpers every layer may use (numpy at most, no torch, no minisched imports)."""
