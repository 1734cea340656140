"""A small, genuinely sharded Llama-style trainer for MindSpore on CPU, and its launcher.

ckptd is only as real as the jobs it serves: this package trains under ``msrun`` with Megatron-style
tensor parallelism and data parallelism, writes per-rank async checkpoints plus a MindSpore strategy
file exactly like production jobs, and resumes bit-exactly from them. Nothing is imported at package
import time (MindSpore takes seconds to import); use ``python -m trainer.train`` under ``msrun`` or
``python -m trainer.launch``.
"""
