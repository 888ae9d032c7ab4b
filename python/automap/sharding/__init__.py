"""Sharding foundation: device meshes with their link model, sharding specs, the
layout manager (optimal conversion paths, cached, in the Rust core) and the
autograd collectives and process groups that execute them. Receives shapes,
specs and meshes; hands costs to ``solve`` and runnable conversions to
``generate``. Imports nothing of automap but ``errors`` and the native core."""
