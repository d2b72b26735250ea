"""Lightning."""
