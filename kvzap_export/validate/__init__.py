"""Parity checks of exported artifacts against the PyTorch reference."""
