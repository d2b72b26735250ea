"""The checkpoint files' engine."""
