"""rlfeed: a trajectory data-loading sidecar for RL training of LLM agents.

Subpackages: `rlfeed.sched` (pure numpy scheduling core), `rlfeed.service` (gRPC, Ray,
metrics, CLI), `rlfeed.client` (producer, batch loader, torch ops), `rlfeed.proto` (wire
contract). Importing `rlfeed` does no work: no threads, servers or heavy imports.
"""

__version__ = "0.1.0"
