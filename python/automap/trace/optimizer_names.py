"""The optimizers whose state the profiler knows, by name, without importing
torch (the command line offers them in --help)."""

OPTIMIZER_NAMES = ("sgd", "sgd_momentum", "adam", "adamw")
