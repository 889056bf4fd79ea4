"""The run configuration (being split into one module per concern; for now all of it is in schema.py)."""
from gspo.config.schema import *  # noqa: F401,F403
