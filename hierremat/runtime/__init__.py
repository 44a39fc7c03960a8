"""The runtime: executing a chain's schedule (stages, block options as generated or compiled
code, residents, tied parameters, FSDP2) and measuring what planning needs (stage and node
profiles, cached stage costs)."""

from .executor import ChainRunner
from .profile import ChainProfile, profile_chain

__all__ = ["ChainProfile", "ChainRunner", "profile_chain"]
