"""Per-module precision policies for Flax linen and NNX (imports Flax)."""
