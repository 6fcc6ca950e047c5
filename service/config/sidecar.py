"""`SidecarConfig`: every section of one `rlfeed serve`, and the checks that span two."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfeed.service.config.fields import require
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

_require = require


@dataclass(kw_only=True, frozen=True)
class SidecarConfig:
    """The whole resolved configuration of one `rlfeed serve`."""

    server: ServerConfig = field(default_factory=ServerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    rollouts: RolloutsConfig = field(default_factory=RolloutsConfig)
    advantages: AdvantagesConfig = field(default_factory=AdvantagesConfig)
    curriculum: CurriculumSection = field(default_factory=CurriculumSection)
    accounting: AccountingConfig = field(default_factory=AccountingConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    frontends: FrontendsConfig = field(default_factory=FrontendsConfig)

    def __post_init__(self) -> None:
        _require(
            not (self.frontends.count and self.server.replicas > 1),
            "server",
            "replicas",
            "must be 1 with [frontends] count > 0 (Ray places the front-ends then)",
        )
        _require(
            self.rollouts.max_buffered_bytes >= self.server.max_message_bytes,
            "rollouts",
            "max_buffered_bytes",
            f"must be >= [server] max_message_bytes ({self.server.max_message_bytes}): "
            "the largest batch must fit",
        )

    @property
    def model_attention_weight(self) -> float:
        """The [accounting] model's weight: tokens + it x sum(L^2) is proportional to the
        model's FLOPs (`rlfeed.sched.compute`); the step's compute figures use it."""
        from rlfeed.sched.compute import model_attention_weight

        return model_attention_weight(self.accounting.model)

    @property
    def resolved_attention_weight(self) -> float:
        """[batching] attention_weight, or the model's when it is FROM_MODEL."""
        if self.batching.attention_weight != FROM_MODEL:
            return self.batching.attention_weight
        return self.model_attention_weight

    def step_config(self):
        """The sched.assembly.StepConfig this run assembles steps with."""
        from rlfeed.sched.assembly import StepConfig

        return StepConfig(
            token_budget=self.batching.token_budget,
            world_size=self.batching.world_size,
            cost_model=self.batching.cost_model,
            packing_method=self.batching.packing_method,
            attention_weight=self.resolved_attention_weight,
            compute_weight=self.model_attention_weight,
            advantage_mode=self.advantages.mode,
            advantage_scale=self.advantages.scale,
            drop_zero_advantage=self.advantages.drop_zero_advantage,
        )
