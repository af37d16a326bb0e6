"""Two gloo ranks; SIGTERM reaches rank 1 only, as srun may deliver it: both ranks agree to stop after the same
step (toolkit/train/job/preemption.py). Each rank prints what it saw."""

import os
import signal
import time

import torch.distributed as dist

from toolkit.train.job import preemption

dist.init_process_group("gloo")
rank = dist.get_rank()
with preemption.stop_on_sigterm():
    preemption.training_started()
    answers = [preemption.agreed_stop()]  # nobody asked yet
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not preemption.requested() and time.monotonic() < deadline:  # the listening thread raises the flag
            time.sleep(0.01)
    answers.append(preemption.agreed_stop())
print(f"rank {rank}: requested={preemption.requested()} agreed={answers}", flush=True)
dist.destroy_process_group()
