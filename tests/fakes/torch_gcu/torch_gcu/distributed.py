"""Fake torch_gcu.distributed: the extra collectives over plain torch.distributed."""

import torch.distributed as dist


def is_available():
    return True


def all_reduce_outplace(out, inp, op=dist.ReduceOp.SUM, group=None):
    out.copy_(inp)
    dist.all_reduce(out, op=op, group=group)
    return out
