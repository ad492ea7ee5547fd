"""Suite-wide settings. Area fixtures live in tests/<area>/conftest.py."""

import os

import torch

# Tests run many worker processes on a 2-core machine: keep the test process itself lean.
torch.set_num_threads(int(os.environ.get("OMNISTAGE_TEST_THREADS", "1")))
