"""Routing policies: ``Candidate`` in, ``Decision`` out."""
