"""Clusters: devices and measured links (``detect``), tiers fitted to them
(``topology``) and the ranked device meshes they give (``cluster``). Receives
link measurements or a cluster JSON; hands ``DeviceMesh`` candidates and the
device FLOP/s to the planner."""
