"""Shared test setup: tiny models are latency-bound, so one intra-op thread is fastest and steadiest."""

import torch

torch.set_num_threads(1)
