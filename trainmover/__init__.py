"""trainmover: keep distributed PyTorch training running through interruptions."""
__version__ = "0.1.0"
