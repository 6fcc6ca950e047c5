"""The sidecar's configuration: a TOML file mapped onto frozen dataclasses.

One section per concern, one module per owner in this package: `[server]` (`server.py`,
the front-end), `[frontends]` (`scaleout.py`), `[security]`, `[journal]`, and the sections
`rlfeed.sched` computes with (`sections.py`: `[ray]`, `[batching]`, `[rollouts]`,
`[advantages]`, `[curriculum]`, `[accounting]`); `toml.py` reads and writes them. The package
imports nothing else from the service, so every folder may read its section here and none is
imported back (a section beside its owner would make the owner and this package import each
other). Every field carries its meaning, unit and default in its `doc` metadata, which is also what
`dump_config(..., with_docs=True)` prints (the shipped `deploy/rlfeed.example.toml` is exactly
that output). Unknown keys, at any level, are an error naming the key and its section; values
are type-checked (an int where a float is expected is fine, a bool where an int is expected
is not).
"""

from rlfeed.service.config.fields import documented
from rlfeed.service.config.journal import JournalConfig
from rlfeed.service.config.scaleout import FrontendsConfig
from rlfeed.service.config.sections import (
    FROM_MODEL,
    AccountingConfig,
    AdvantagesConfig,
    BatchingConfig,
    CurriculumSection,
    RayConfig,
    RolloutsConfig,
)
from rlfeed.service.config.security import SecurityConfig
from rlfeed.service.config.server import ServerConfig
from rlfeed.service.config.sidecar import SidecarConfig
from rlfeed.service.config.toml import (
    EXAMPLE_HEADER,
    config_from_dict,
    config_to_dict,
    dump_config,
    example_config_text,
    load_config,
    with_overrides,
)

__all__ = [
    "EXAMPLE_HEADER",
    "FROM_MODEL",
    "AccountingConfig",
    "AdvantagesConfig",
    "BatchingConfig",
    "CurriculumSection",
    "FrontendsConfig",
    "JournalConfig",
    "RayConfig",
    "RolloutsConfig",
    "SecurityConfig",
    "ServerConfig",
    "SidecarConfig",
    "config_from_dict",
    "config_to_dict",
    "documented",
    "dump_config",
    "example_config_text",
    "load_config",
    "with_overrides",
]
