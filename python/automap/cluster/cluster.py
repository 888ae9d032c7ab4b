"""The cluster: its devices, the measured latency and bandwidth of every pair,
the fitted tiers, and the candidate device meshes a planner tries.

A cluster comes from ``automap.detect_cluster`` (measured) or from a JSON file,
which can be written by hand for a cluster one plans for but is not on.

JSON schema, version 1 (``Cluster.to_json`` writes it, ``from_json`` reads it)::

    {
      "format": "automap.cluster.cluster",          # optional when written by hand
      "version": 1,                         # required
      "devices": [                          # one object per global rank, or just N
        {"rank": 0, "host": "node0", "local_rank": 0, "kind": "cuda",
         "name": "NVIDIA A100-SXM4-80GB",
         "sustained_flops_per_s": 2.5e14,   # optional: measured matmul rate
         "memory_bandwidth_bytes_per_s": 1.5e12,  # optional: measured elementwise rate
         "op_overhead_s": 5e-06,            # optional: measured time of a tiny kernel
         "shared_slowdown": 1.0,            # optional: alone / all ranks computing (>= 1)
         "library_workspace_bytes": 69206016,  # optional: cuBLAS/cuBLASLt workspaces
         "memory_bytes": 85899345920}       # optional: device memory
      ],                                    # kind: "cpu" (the default) trains on gloo,
                                            # whose collectives the meshes price
      "device": {...},                      # when "devices" is N: fields for every device
      "hosts": ["node0"],                   # written for the reader, ignored on loading
      "links": {                            # pair matrices, N x N, diagonal ignored
        "alpha_s": [[0, 5e-06, ...], ...],
        "bandwidth_bytes_per_s": [[0, 2e11, ...], ...]
      },
      "tiers": [                            # fastest first; see below
        {"groups": [[0, 1], [2, 3]],        # or "group_size": 2 (consecutive ranks)
         "alpha_s": 5e-06, "bandwidth_bytes_per_s": 2e11, "pairs": 4}
      ],
      "tier_rel_tol": 0.25,                 # optional: tier clustering tolerance
      "group_links": [                      # optional: measured group all-reduces
        {"groups": [[0, 1, 2, 3], [4, 5, 6, 7]],
         "alpha_s": 3e-05, "bandwidth_bytes_per_s": 1.8e10}
      ],
      "measurement": {...}                  # optional, free-form: how it was measured
    }

``links`` is the source of truth. ``tiers`` is written for the reader (the fit
of ``links``) and ignored on loading when ``links`` is present, because the
tiers are refitted from it. Without ``links``, ``tiers`` defines the cluster:
the link between two devices is that of the first (fastest) tier with a group
holding both, and the last tier must hold every device in one group. Bandwidths
are bus bandwidths in bytes/s (a ring all-reduce of S bytes over n devices
takes alpha_s + 2 (n-1)/n * S / bandwidth), latencies are seconds. For example,
the MAP paper's 8-GPU box by hand::

    {"version": 1, "devices": 8,
     "device": {"kind": "cuda", "name": "A100", "sustained_flops_per_s": 1.5e14},
     "tiers": [{"group_size": 2, "alpha_s": 5e-6, "bandwidth_bytes_per_s": 2e11},
               {"group_size": 4, "alpha_s": 1e-5, "bandwidth_bytes_per_s": 2e10},
               {"group_size": 8, "alpha_s": 2e-5, "bandwidth_bytes_per_s": 1e10}]}
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from automap.cluster.topology import (
    DEFAULT_REL_TOL,
    GroupLink,
    MeshCandidate,
    Tier,
    Topology,
    candidate_meshes,
    check_link_matrices,
    fit_tiers,
)
from automap.errors import InvalidMeshError
from automap.sharding.mesh import DeviceMesh

FORMAT = "automap.cluster.cluster"
VERSION = 1


@dataclass(frozen=True)
class Device:
    """One device (a global rank). Its profile (``sustained_flops_per_s``,
    ``memory_bandwidth_bytes_per_s``, ``op_overhead_s``, ``shared_slowdown``:
    see ``automap.cluster.device``) and ``memory_bytes`` are None when unknown
    (files written before ``shared_slowdown`` was stored load with None: a
    plan then takes 1, a device per rank)."""

    rank: int
    host: str = "localhost"
    local_rank: int = 0
    kind: str = "cpu"
    name: str = ""
    sustained_flops_per_s: float | None = None
    memory_bytes: int | None = None
    memory_bandwidth_bytes_per_s: float | None = None
    op_overhead_s: float | None = None
    shared_slowdown: float | None = None
    #: What its math libraries hold through a step (``automap.cluster.workspace``).
    library_workspace_bytes: int | None = None


class Cluster:
    """Devices and the N x N pair matrices of latency (``alpha_s``) and bus
    bandwidth (``bandwidth_bytes_per_s``); optional measured group
    all-reduces (``group_links``) override the pair-derived cost of a mesh
    axis with exactly those groups. Tiers and meshes are fitted on demand."""

    def __init__(
        self,
        devices: Sequence[Device] | int,
        alpha_s: ArrayLike,
        bandwidth_bytes_per_s: ArrayLike,
        *,
        group_links: Sequence[GroupLink] = (),
        rel_tol: float = DEFAULT_REL_TOL,
        measurement: dict | None = None,
    ) -> None:
        if isinstance(devices, int):
            devices = [Device(rank=r) for r in range(devices)]
        self.devices: tuple[Device, ...] = tuple(devices)
        n = len(self.devices)
        if n < 1:
            raise InvalidMeshError("a cluster needs at least one device")
        if [d.rank for d in self.devices] != list(range(n)):
            raise InvalidMeshError("devices must be listed by rank 0..N-1, each once")
        self.alpha_s, self.bandwidth_bytes_per_s = check_link_matrices(
            alpha_s, bandwidth_bytes_per_s
        )
        if self.bandwidth_bytes_per_s.shape != (n, n):
            raise InvalidMeshError(
                f"{n} devices but link matrices of shape {self.bandwidth_bytes_per_s.shape}"
            )
        for link in group_links:
            members = sorted(r for g in link.groups for r in g)
            if members != list(range(n)):
                raise InvalidMeshError(
                    f"group link {link.groups} must partition the ranks 0..{n - 1}"
                )
            if not (link.bandwidth_bytes_per_s > 0 and link.alpha_s >= 0):
                raise InvalidMeshError(f"group link {link.groups} needs bandwidth > 0, alpha >= 0")
        self.group_links: tuple[GroupLink, ...] = tuple(group_links)
        if not rel_tol > 0:
            raise InvalidMeshError(f"tier_rel_tol must be > 0, got {rel_tol}")
        self.rel_tol = float(rel_tol)
        self.measurement: dict = dict(measurement or {})

    # Devices ------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names in order of their first rank."""
        return tuple(dict.fromkeys(d.host for d in self.devices))

    @property
    def sustained_flops_per_s(self) -> float | None:
        """The slowest device's sustained FLOP/s (it paces a synchronous
        step), None unless known for every device."""
        values = [d.sustained_flops_per_s for d in self.devices]
        known = [v for v in values if v is not None]
        return float(min(known)) if known and len(known) == len(values) else None

    @property
    def device_profile(self) -> dict[str, float | None]:
        """The slowest device's profile fields (``automap.cluster.device.FIELDS``
        and ``shared_slowdown``, the largest) and the largest
        ``library_workspace_bytes``, each None unless known for every device."""

        def known(values: list[float | None], pick: Callable[[list[float]], float]
                  ) -> float | None:
            present = [v for v in values if v is not None]
            return float(pick(present)) if present and len(present) == len(values) else None

        return {
            "flops_per_s": self.sustained_flops_per_s,
            "memory_bandwidth_bytes_per_s": known(
                [d.memory_bandwidth_bytes_per_s for d in self.devices], min),
            "op_overhead_s": known([d.op_overhead_s for d in self.devices], max),
            "shared_slowdown": known([d.shared_slowdown for d in self.devices], max),
            "library_workspace_bytes": known(
                [d.library_workspace_bytes for d in self.devices], max),
        }

    @property
    def device_kind(self) -> str:
        """The devices' type (``cuda`` if any device is a GPU)."""
        return "cuda" if any(d.kind == "cuda" for d in self.devices) else "cpu"

    @property
    def backend(self) -> str:
        """The torch.distributed backend these devices train with: nccl on
        GPUs, gloo on CPUs (it prices the collectives as they run there)."""
        return "nccl" if self.device_kind == "cuda" else "gloo"

    @property
    def memory_bytes(self) -> int | None:
        """The smallest device memory, None unless known for every device."""
        values = [d.memory_bytes for d in self.devices]
        known = [v for v in values if v is not None]
        return int(min(known)) if known and len(known) == len(values) else None

    # Topology -----------------------------------------------------------------
    @cached_property
    def topology(self) -> Topology:
        return fit_tiers(self.alpha_s, self.bandwidth_bytes_per_s, self.rel_tol)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """Link tiers, fastest first (see ``automap.cluster.topology``)."""
        return self.topology.tiers

    def candidates(self, max_axes: int = 3) -> list[MeshCandidate]:
        """Candidate meshes with their scores and per-axis tiers, best first."""
        return candidate_meshes(self.topology, max_axes=max_axes, group_links=self.group_links)

    def meshes(self, max_axes: int = 3, limit: int | None = None) -> list[DeviceMesh]:
        """Candidate ``DeviceMesh``es, best first: one per ordered factorisation
        of N into up to ``max_axes`` axes, ranks in topology-aware order, each
        axis with its fitted alpha and bus bandwidth. A planner tries the
        first few and keeps the fastest plan."""
        return [c.mesh.with_backend(self.backend) for c in self.candidates(max_axes)[:limit]]

    # Construction by hand ---------------------------------------------------------
    @classmethod
    def from_tiers(cls, devices: Sequence[Device] | int, tiers: Sequence[dict]) -> Cluster:
        """A cluster from a tier description (the JSON's ``tiers``, fastest
        first): each a dict with ``groups`` (lists of ranks) or ``group_size``
        (consecutive ranks), ``alpha_s`` and ``bandwidth_bytes_per_s``."""
        n = devices if isinstance(devices, int) else len(devices)
        return cls(devices, *_tier_matrices(n, tiers))

    # Serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "devices": [asdict(d) for d in self.devices],
            "hosts": list(self.hosts),
            "links": {
                "alpha_s": self.alpha_s.tolist(),
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s.tolist(),
            },
            "tier_rel_tol": self.rel_tol,
            "tiers": [
                {
                    "groups": [list(g) for g in t.groups],
                    "alpha_s": t.alpha_s,
                    "bandwidth_bytes_per_s": t.bandwidth_bytes_per_s,
                    "pairs": t.pairs,
                }
                for t in self.tiers
            ],
            "group_links": [
                {
                    "groups": [list(g) for g in link.groups],
                    "alpha_s": link.alpha_s,
                    "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
                }
                for link in self.group_links
            ],
            "measurement": self.measurement,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Cluster:
        if not isinstance(data, dict):
            raise InvalidMeshError("a cluster description must be a JSON object")
        if data.get("format", FORMAT) != FORMAT:
            raise InvalidMeshError(f"not a cluster description: format {data.get('format')!r}")
        if "version" not in data:
            raise InvalidMeshError(f'a cluster description needs "version": {VERSION}')
        if data["version"] != VERSION:
            raise InvalidMeshError(
                f"cluster description version {data['version']!r}; this automap reads "
                f"version {VERSION}"
            )
        try:
            devices = _devices(data)
            if "links" in data:
                alpha, bandwidth = data["links"]["alpha_s"], data["links"]["bandwidth_bytes_per_s"]
            elif "tiers" in data:
                alpha, bandwidth = _tier_matrices(len(devices), data["tiers"])
            else:
                raise InvalidMeshError('a cluster description needs "links" or "tiers"')
            group_links = [
                GroupLink(
                    tuple(tuple(int(r) for r in g) for g in link["groups"]),
                    float(link["alpha_s"]),
                    float(link["bandwidth_bytes_per_s"]),
                )
                for link in data.get("group_links", [])
            ]
            return cls(
                devices,
                alpha,
                bandwidth,
                group_links=group_links,
                rel_tol=float(data.get("tier_rel_tol", DEFAULT_REL_TOL)),
                measurement=data.get("measurement"),
            )
        except InvalidMeshError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidMeshError(f"malformed cluster description: {e!r}") from e

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(_dumps(self.to_dict()) + "\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Cluster:
        """``from_dict`` of a JSON file (``automap detect`` writes them); a file
        that is no JSON is an ``InvalidMeshError`` (one that cannot be opened,
        the ``OSError`` of ``open``)."""
        with open(path, "rb") as f:
            try:
                data = json.loads(f.read().decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InvalidMeshError(f"{path}: not valid JSON: {e}") from e
        return cls.from_dict(data)

    # Display ------------------------------------------------------------------------
    def summary(self, top: int = 4) -> str:
        """Devices, tiers and the best few candidate meshes, for people."""
        kinds = sorted({f"{d.kind} {d.name}".strip() for d in self.devices})
        lines = [f"{self.num_devices} devices on {len(self.hosts)} host(s): {', '.join(kinds)}"]
        profile = self.device_profile
        if profile["flops_per_s"] is not None:
            lines.append(f"sustained compute {profile['flops_per_s']:.3g} FLOP/s per device")
        if profile["memory_bandwidth_bytes_per_s"] is not None:
            lines.append(f"memory bandwidth {profile['memory_bandwidth_bytes_per_s'] / 1e9:.3g} "
                         "GB/s per device")
        if profile["op_overhead_s"] is not None:
            lines.append(f"kernel overhead {profile['op_overhead_s'] * 1e6:.3g} us")
        if profile["library_workspace_bytes"]:
            mib = profile["library_workspace_bytes"] / 2**20
            lines.append(f"math libraries' workspaces {mib:.4g} MiB per device")
        if (profile["shared_slowdown"] or 1.0) > 1.0:
            lines.append(f"ranks share their compute: {profile['shared_slowdown']:.3g}x faster "
                         "alone than all at once")
        for i, t in enumerate(self.tiers):
            sizes = sorted({len(g) for g in t.groups})
            lines.append(
                f"tier {i}: {t.bandwidth_bytes_per_s / 1e9:9.3f} GB/s  alpha "
                f"{t.alpha_s * 1e6:8.1f} us  {t.pairs} pairs, groups of {sizes}"
            )
        best = self.candidates()[:top]
        for c in best:
            m = c.mesh
            axes = ", ".join(
                f"{s}@{b / 1e9:.3g}GB/s{'*' if meas else ''}"
                for s, b, meas in zip(m.shape, m.bandwidth_bytes_per_s, c.measured_axes)
            )
            lines.append(f"mesh {m.shape} [{axes}] ranks {list(m.ranks)} score {c.score_s:.4g} s")
        if any(any(c.measured_axes) for c in best):
            lines.append("(* axis cost from a measured group all-reduce)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Cluster({self.num_devices} devices, {len(self.tiers)} tiers)"


def _dumps(value: Any, indent: str = "") -> str:
    """JSON with one line per list of numbers (a matrix row, a group) and per
    flat record (a device), so a 512-device matrix stays 512 lines, and nested
    objects indented."""
    inner = indent + "  "
    if isinstance(value, dict) and value and not any(isinstance(v, (dict, list))
                                                     for v in value.values()) and indent:
        return json.dumps(value)  # a flat record (a device) on one line
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value)


def _devices(data: dict) -> list[Device]:
    devices = data.get("devices")
    if isinstance(devices, int):
        template = dict(data.get("device", {}))
        return [Device(rank=r, **template) for r in range(devices)]
    if not isinstance(devices, list):
        raise InvalidMeshError('"devices" must be a list of device objects or a count')
    return [Device(**d) for d in devices]


def _tier_matrices(n: int, tiers: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    # Each pair takes the first (fastest) tier that has a group holding both.
    alpha = np.full((n, n), np.nan)
    bandwidth = np.full((n, n), np.nan)
    for i, tier in enumerate(tiers):
        for group in _tier_groups(tier, n, i):
            block = np.ix_(group, group)
            unset = np.isnan(bandwidth[block])
            alpha[block] = np.where(unset, float(tier["alpha_s"]), alpha[block])
            bandwidth[block] = np.where(
                unset, float(tier["bandwidth_bytes_per_s"]), bandwidth[block]
            )
    np.fill_diagonal(alpha, 0.0)
    np.fill_diagonal(bandwidth, 0.0)
    if np.isnan(bandwidth).any():
        i, j = (int(x[0]) for x in np.nonzero(np.isnan(bandwidth)))
        raise InvalidMeshError(
            f"no tier links devices {i} and {j}: the last tier must hold every device"
        )
    return alpha, bandwidth


def _tier_groups(tier: dict, n: int, index: int) -> list[list[int]]:
    if "groups" in tier:
        groups = [[int(r) for r in g] for g in tier["groups"]]
        flat = [r for g in groups for r in g]
        if len(flat) != len(set(flat)) or not all(0 <= r < n for r in flat):
            raise InvalidMeshError(f"tier {index}: groups must be disjoint ranks in 0..{n - 1}")
        return groups
    size = int(tier["group_size"])
    if size < 1 or n % size:
        raise InvalidMeshError(f"tier {index}: group_size {size} does not divide {n} devices")
    return [list(range(s, s + size)) for s in range(0, n, size)]
