"""``python -m rlbus.learner``: parse settings first, import torch only after.

Under ``torchrun --nproc_per_node N -m rlbus.learner``, rank 0 is the service and
every other rank a follower that trains its share of each step (see :mod:`.distributed`).
"""

import os

from rlbus.runner import run_service

if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) > 0:
        from rlbus.learner.follower import follow

        follow()
    else:
        run_service("learner")
