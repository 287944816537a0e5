"""The tile math moved to ``torchneuron.kernels.tilemath`` (it is kernel code, below the ops layer).

This module keeps the old import path working for the graph compiler until its imports follow; nothing
in ``torchneuron.ops`` imports it. Delete it then.
"""
from torchneuron.kernels.tilemath import *  # noqa: F401,F403
