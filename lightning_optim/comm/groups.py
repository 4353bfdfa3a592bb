"""Size, rank and backend of a process group, for torch's registered groups and for group objects alike."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["backend_name", "group_rank", "is_group_object", "world_size"]


def is_group_object(group) -> bool:
    """Whether ``group`` is a process-group object used as it is: one that torch.distributed's registry may not
    know (a fault-tolerant replica group reconfigured at every quorum, in a process with no default group)."""
    return group is not None and isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.WORLD


def world_size(group=None) -> int:
    """Ranks in ``group``; 1 when torch.distributed is not initialized and ``group`` is not a group object."""
    if is_group_object(group):
        return group.size()
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError(f"this rank (global rank {dist.get_rank()}) is not a member of group {group!r}")
    return size


def group_rank(group=None) -> int:
    """This process's rank in ``group`` (0 without torch.distributed). A group object answers itself: torch's
    ``get_rank(group)`` needs the group in the default group's registry."""
    if is_group_object(group):
        return group.rank()
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def backend_name(group=None) -> str:
    """The backend of ``group`` in lower case (``"gloo"``, ``"nccl"``; ``""`` without torch.distributed)."""
    if is_group_object(group):
        try:
            return str(dist.get_backend(group)).lower()
        except (KeyError, ValueError, RuntimeError):  # not in torch's registry: the group names its own backend
            return str(group.name()).lower()
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return str(dist.get_backend(group)).lower()
