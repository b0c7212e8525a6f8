"""The server's version, in a module of its own so that what reports it imports nothing else."""

__version__ = "0.1.0"
