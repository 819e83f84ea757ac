"""Operator endpoints behind the admin key (``/admin/*``), ``explain``, and the demo's local admin key."""
