"""accelerate."""
