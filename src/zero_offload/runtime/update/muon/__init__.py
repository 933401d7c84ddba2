"""Muon: its update on the device and on the host, its momentum state, the split of params
into Muon and Adam groups, and its Newton-Schulz math."""
