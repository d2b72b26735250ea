"""DeepSpeed."""
