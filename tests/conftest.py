"""Suite-wide settings: one torch thread (the suite's models are tiny; on a loaded 2-core
machine two threads ran an SFT step 14x slower than one), no model hub, and the Hypothesis
profiles.

Hypothesis profiles: ``ci``, the default (so the README's test command is exactly what CI
runs), is Hypothesis's own (derandomized: the same examples every run, so CI is
reproducible) with 200 examples for the properties that take their count from the profile
(``tests/advantages/test_properties.py``); ``HYPOTHESIS_PROFILE=dev`` draws 100 new random
examples each run and replays failures from the local example database, for hunting new
counterexamples while developing. The scale-invariance
property that was stated too broadly (issue 24) fails within 10 derandomized examples of
its strategy.
"""

import os

from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; run.threads=0 (auto) reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

torch.set_num_threads(1)

settings.register_profile("ci", settings.get_profile("ci"), max_examples=200)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")
