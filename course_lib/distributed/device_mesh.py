"""A mesh of processes with named dimensions, one process group per row of each dimension.

PyTorch counterpart: ``torch.distributed.device_mesh.init_device_mesh`` and ``DeviceMesh``
(same signature and the same groups; torch's also feeds DTensor and slices several dimensions
at once). Read more: https://pytorch.org/tutorials/recipes/distributed_device_mesh.html and
torchtitan's ``ParallelDims``.

The layout: the ranks ``0 ... world - 1`` fill the mesh row-major, the last dimension innermost,
so neighbours along the last dimension have consecutive ranks. A launcher numbers the processes
of one machine consecutively, so the last dimension stays inside a machine, on its fast links:
put tensor parallelism there (it communicates in every layer) and data parallelism first (one
all-reduce of gradients per step). On a (2, 2) mesh named ("dp", "tp"):

    mesh = [[0, 1],      tp groups: the rows    {0, 1} and {2, 3}
            [2, 3]]      dp groups: the columns {0, 2} and {1, 3}
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["DeviceMesh", "init_device_mesh"]


class DeviceMesh:
    """The ranks of a job laid out as a tensor, with this rank's group in each dimension.

    Build it with ``init_device_mesh``. ``mesh`` is the tensor of global ranks; ``mesh[name]``
    is this rank's row along dimension ``name`` (a 1-D ``DeviceMesh``), ``get_group(name)`` its
    process group, ``get_local_rank(name)`` this rank's place in that group.
    """

    def __init__(self, device_type: str, mesh: torch.Tensor, mesh_dim_names: tuple[str, ...],
                 groups: Sequence[dist.ProcessGroup]):
        self.device_type = device_type
        self.mesh = mesh                                      # (d0, d1, ...) of global ranks
        self.mesh_dim_names = mesh_dim_names
        self._groups = list(groups)                           # this rank's group per dimension

    @property
    def ndim(self) -> int:
        return self.mesh.dim()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def _dim(self, mesh_dim: int | str | None) -> int:
        """The index of dimension ``mesh_dim`` (a name or an index; None for a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise RuntimeError(f"this DeviceMesh has {self.ndim} dimensions "
                                   f"{self.mesh_dim_names}: name the one you mean.")
            return 0
        if isinstance(mesh_dim, str):
            if mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"DeviceMesh has no dimension {mesh_dim!r}; its dimensions are "
                               f"{self.mesh_dim_names}.")
            return self.mesh_dim_names.index(mesh_dim)
        if not 0 <= mesh_dim < self.ndim:
            raise IndexError(f"DeviceMesh has dimensions 0 ... {self.ndim - 1}, got {mesh_dim}.")
        return mesh_dim

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index in every dimension (None if it is not in the mesh)."""
        where = (self.mesh == dist.get_rank()).nonzero()
        return tuple(where[0].tolist()) if len(where) else None

    def __getitem__(self, name: str) -> DeviceMesh:
        """This rank's 1-D sub-mesh along dimension ``name``: the row of ranks that vary in it."""
        if not isinstance(name, str):
            raise TypeError(f"index a DeviceMesh by one dimension name (one of "
                            f"{self.mesh_dim_names}), got {name!r}.")
        dim, coordinate = self._dim(name), self.get_coordinate()
        index = [slice(None) if d == dim else c for d, c in enumerate(coordinate)]
        return DeviceMesh(self.device_type, self.mesh[tuple(index)], (name,),
                          [self._groups[dim]])

    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """This rank's process group along ``mesh_dim``."""
        return self._groups[self._dim(mesh_dim)]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (its rank in that dimension's group)."""
        return self.get_coordinate()[self._dim(mesh_dim)]

    def size(self, mesh_dim: int | str | None = None) -> int:
        """The number of ranks along ``mesh_dim``, or in the whole mesh when None."""
        if mesh_dim is None:
            return self.mesh.numel()
        return self.mesh.shape[self._dim(mesh_dim)]

    def __repr__(self) -> str:
        names = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.shape))
        return f"DeviceMesh({self.device_type!r}, ({names}), mesh={self.mesh.tolist()})"


def _check(mesh_shape: tuple[int, ...], names: tuple[str, ...], world: int) -> None:
    """Clear errors for a shape that does not cover the world or names that do not fit it."""
    if not mesh_shape or any(not isinstance(s, int) or s < 1 for s in mesh_shape):
        raise ValueError(f"init_device_mesh expects mesh_shape to be positive ints, got "
                         f"{mesh_shape!r}.")
    if math.prod(mesh_shape) != world:
        raise ValueError(f"init_device_mesh: mesh_shape {mesh_shape} holds "
                         f"{math.prod(mesh_shape)} ranks but the world has {world}; choose "
                         f"sizes whose product is {world} (or launch {math.prod(mesh_shape)} "
                         "processes).")
    if len(names) != len(mesh_shape):
        raise ValueError(f"init_device_mesh: {len(mesh_shape)} dimensions {mesh_shape} but "
                         f"{len(names)} names {names}; give one name per dimension.")
    if len(set(names)) != len(names):
        raise ValueError(f"init_device_mesh: dimension names must differ, got {names}.")


def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *,
                     mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
    """Lay the world's ranks out as ``mesh_shape`` and make one group per row of each dimension.

    Every rank must call it, with the same arguments: ``dist.new_group`` is collective over the
    whole world, so every rank creates every group, in the same order, even the groups it is
    not in (it keeps only its own). A dimension that spans the whole world uses the default
    group, as torch's does.

    Args:
        device_type: where the mesh's tensors live ("cpu", "cuda", ...): recorded, as torch's.
        mesh_shape: the size of each dimension, outermost first; their product is the world.
        mesh_dim_names: one name per dimension (default "dim0", "dim1", ...).

    Returns:
        A ``DeviceMesh`` whose ``mesh`` is ``arange(world).view(mesh_shape)``.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_device_mesh lays out the ranks of a process group: call "
                           "dist.init_process_group first (or start the workers with "
                           "course_lib.distributed.launch).")
    mesh_shape = tuple(mesh_shape)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(
        f"dim{d}" for d in range(len(mesh_shape)))
    world, rank = dist.get_world_size(), dist.get_rank()
    _check(mesh_shape, names, world)
    mesh = torch.arange(world).view(mesh_shape)               # row-major: last dim innermost
    groups = []
    for dim, size in enumerate(mesh_shape):
        if size == world:                                     # the whole world: nothing to make
            groups.append(dist.group.WORLD)
            continue
        rows = mesh.movedim(dim, -1).reshape(-1, size)        # (world / size, size): the groups
        for row in rows.tolist():                             # every rank makes every group
            group = dist.new_group(ranks=row)
            if rank in row:
                groups.append(group)
    return DeviceMesh(device_type, mesh, names, groups)
