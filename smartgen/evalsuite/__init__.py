"""Offline long-context evaluation suite (RULER / passkey style), generated from a seed."""
