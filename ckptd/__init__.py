"""ckptd: checkpoint management and fault tolerance for MindSpore training."""

__version__ = "0.1.0"
