"""Megatron."""
