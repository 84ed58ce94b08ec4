"""Every Python process a test starts prints all its threads' stacks on SIGUSR2.

tests/launch.py puts this folder on PYTHONPATH, and sends SIGUSR2 to a launch that has hung before it kills it,
so a hang fails with where each process (ranks, torchrun agents, DataLoader workers) was waiting.
"""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR2, all_threads=True)
