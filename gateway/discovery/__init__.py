"""Replica discovery: sources that tell the gateway which replicas a pool has right now.

A source (DNS, Kubernetes EndpointSlices) only *reports* endpoints; ``gateway.discovery.membership``
turns reports into replicas, pools and drains.  Sources never touch routing state.
"""
