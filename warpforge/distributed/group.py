"""The process group an op runs over: checked once, at the door, before any collective (without a group there
is no one to tell), for every op of the package; and the tensor collectives under the names this torch has."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch.distributed as dist

from ..errors import fail

# torch 2.13 renamed the tensor collectives (the old names warn); the GPU machine's torch 2.11 has only the old ones
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Group(NamedTuple):
    group: Optional[dist.ProcessGroup]  # None: the world
    rank: int                           # this process's rank in it
    world: int                          # its size

    def global_rank(self, r: int) -> int:
        """The world rank of the group's rank r (what point-to-point calls take)."""
        return r if self.group is None else dist.get_global_rank(self.group, r)


def resolve_group(group, purpose: str) -> Group:
    """`group` (None: the world) as a Group; a WarpforgeInputError if torch.distributed is not initialized, group
    is not a process group, or this process is not in it. purpose: what the ranks are for, for the message."""
    if not (dist.is_available() and dist.is_initialized()):
        fail("group", f"an initialized torch.distributed process group (call torch.distributed.init_process_group "
             f"on every rank first; {purpose})", "no process group initialized")
    # new_group hands processes outside the new group a sentinel (an int), not a ProcessGroup
    outside = isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER
    if group is not None and not outside and not isinstance(group, dist.ProcessGroup):
        fail("group", "None (the world) or a torch.distributed ProcessGroup", type(group).__name__)
    rank = -1 if outside else dist.get_rank(group)
    if rank < 0:
        fail("group", "a process group this process belongs to", f"a group without global rank {dist.get_rank()}")
    return Group(group, rank, dist.get_world_size(group))
