"""Routing state shared between gateway processes."""
