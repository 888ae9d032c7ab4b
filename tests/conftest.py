import os
import sys

# Spawned gloo workers import helpers from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
