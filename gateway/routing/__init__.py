"""Routing: policies choose a replica for a request; see ``base`` for the contract."""
