"""The search that ``automap.plan`` runs: trace and profile, the ILP alone or
MAP's two-stage ladder (ILP rungs checkpointed by the rotor DP) over one or
several meshes (``search``), packaged as the versioned ``Plan`` record
(``plan``). Receives a model or a traced graph; hands a ``Plan`` to
``generate`` (and to JSON)."""
