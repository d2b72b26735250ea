"""torchtitan."""
