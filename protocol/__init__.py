"""Atoll pure protocol logic (sans-IO)."""
