"""Suite-wide settings: one torch thread (the suite's models are tiny; on a loaded 2-core
machine two threads ran an SFT step 14x slower than one), and no model hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; run.threads=0 (auto) reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

torch.set_num_threads(1)
