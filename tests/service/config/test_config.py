"""The TOML config: typed sections, unknown keys rejected, documented example in sync."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import get_type_hints

import pytest
import tomllib
from rlfeed.sched.assembly import StepConfig
from rlfeed.sched.compute import model_attention_weight
from rlfeed.sched.curriculum import CurriculumConfig
from rlfeed.sched.rounds import StepGroups
from rlfeed.service.config import (
    RolloutsConfig,
    SidecarConfig,
    config_from_dict,
    dump_config,
    example_config_text,
    load_config,
    with_overrides,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "rlfeed.example.toml"


def test_example_file_is_the_documented_default_config() -> None:
    assert EXAMPLE.read_text() == example_config_text(), (
        "deploy/rlfeed.example.toml is out of date: write example_config_text() to it"
    )
    assert load_config(EXAMPLE) == SidecarConfig()


def test_every_field_is_documented_in_the_example() -> None:
    text = EXAMPLE.read_text()
    for section in dataclasses.fields(SidecarConfig):
        assert f"[{section.name}]" in text
        for item in dataclasses.fields(section.default_factory()):
            assert item.metadata.get("doc"), f"{section.name}.{item.name} has no doc"
            assert f"\n{item.name} = " in text


def test_toml_file_overrides_only_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[batching]\ntoken_budget = 8192\nworld_size = 4\n[server]\nport = 0\n")
    config = load_config(path)
    assert (config.batching.token_budget, config.batching.world_size) == (8192, 4)
    assert config.server.port == 0
    assert config.rollouts == SidecarConfig().rollouts


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"batching": {"token_budgit": 1}},
            r"unknown config key 'token_budgit' in section \[batching\]",
        ),
        ({"servers": {}}, r"unknown config key 'servers' in the top level"),
        ({"batching": {"world_size": "2"}}, r"\[batching\] world_size: expected int"),
        ({"advantages": {"drop_zero_advantage": 1}}, r"drop_zero_advantage: expected bool"),
        ({"rollouts": {"group_size": True}}, r"\[rollouts\] group_size: expected int"),
        ({"batching": {"cost_model": "dense"}}, r"\[batching\] cost_model"),
        ({"rollouts": {"group_size": 0}}, r"\[rollouts\] group_size: must be >= 1"),
        ({"rollouts": {"max_version_jump": 0}}, r"\[rollouts\] max_version_jump: must be >= 1"),
        (
            {"rollouts": {"dedup_window_groups": 0}},
            r"\[rollouts\] dedup_window_groups: must be >= 1",
        ),
        ({"curriculum": {"estimator": "median"}}, r"\[curriculum\] estimator must be one of"),
        ({"accounting": {"gpu": "tpu"}}, r"\[accounting\] gpu: one of"),
        ({"server": 3}, r"\[server\] must be a table"),
        ({"server": {"retained_free_mib": -1}}, r"\[server\] retained_free_mib: must be in"),
        ({"server": {"retained_free_mib": 2048}}, r"\[server\] retained_free_mib: must be in"),
        (
            {"rollouts": {"step_groups": "dynamic"}},
            r"\[rollouts\] step_groups: expected one of 'fixed', 'sampled', got 'dynamic'",
        ),
        ({"rollouts": {"step_groups": 8}}, r"\[rollouts\] step_groups: expected one of"),
    ],
)
def test_bad_config_names_the_key_and_section(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_dict(values)


def test_step_groups_is_typed_as_the_round_queue_modes() -> None:
    """The config's Literal is the one `sched.rounds` steps by; "fixed" (today's rule) is
    the default, and a dataclass built in code is checked too."""
    assert get_type_hints(RolloutsConfig)["step_groups"] == StepGroups
    assert SidecarConfig().rollouts.step_groups == "fixed"
    with pytest.raises(ValueError, match=r"\[rollouts\] step_groups: one of"):
        RolloutsConfig(step_groups="dynamic")  # type: ignore[arg-type]


def test_enum_like_fields_are_typed_as_sched_spells_them() -> None:
    """The config spells sched/'s Literals again (those modules import numpy): the same
    values. The curriculum's are checked by sched.curriculum, whose message users see."""
    from rlfeed.sched import advantages, budgets, curriculum, packing
    from rlfeed.service.config import sections

    assert sections.CostModel == budgets.CostModel
    assert sections.PackingMethod == packing.PackingMethod
    assert sections.AdvantageMode == advantages.AdvantageMode
    assert sections.Estimator == curriculum.Estimator
    assert sections.Sampling == curriculum.Sampling
    hints = get_type_hints(sections.CurriculumSection)
    assert (hints["estimator"], hints["sampling"]) == (curriculum.Estimator, curriculum.Sampling)
    with pytest.raises(ValueError, match=r"\[curriculum\] sampling must be one of"):
        config_from_dict({"curriculum": {"sampling": "hard"}})
    with pytest.raises(ValueError, match=r"\[curriculum\] sampling: expected str, got 1"):
        config_from_dict({"curriculum": {"sampling": 1}})


def test_bad_file_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[rollouts]\nmax_policy_lagg = 2\n")
    with pytest.raises(ValueError, match=r"bad\.toml: unknown config key 'max_policy_lagg'"):
        load_config(path)


def test_an_int_is_accepted_where_a_float_is_expected() -> None:
    config = config_from_dict({"curriculum": {"low": 0, "high": 1}})
    assert isinstance(config.curriculum.low, float)


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_dumped_config_reads_back_to_the_same_config(fmt: str) -> None:
    config = with_overrides(
        SidecarConfig(),
        batching={"token_budget": 4096, "cost_model": "padded"},
        curriculum={"sampling": "soft", "seed": 7},
        advantages={"drop_zero_advantage": True},
        rollouts={"step_groups": "sampled"},
    )
    text = dump_config(config, fmt)
    values = tomllib.loads(text) if fmt == "toml" else json.loads(text)
    assert config_from_dict(values) == config


def test_attention_weight_defaults_to_the_accounting_models_own() -> None:
    for model in ("qwen3-0.6b", "llama3-70b"):
        config = with_overrides(SidecarConfig(), accounting={"model": model})
        assert config.step_config().attention_weight == model_attention_weight(model)
        # The dump keeps following the model and prints the resolved number next to it.
        text = dump_config(config, "toml")
        line = next(x for x in text.splitlines() if x.startswith("attention_weight"))
        assert line.startswith("attention_weight = -1.0  # resolved: ")
        assert f"{model_attention_weight(model):.4g} from {model}" in line
        assert config_from_dict(tomllib.loads(text)) == config


def test_an_explicit_attention_weight_wins_and_prints_alone() -> None:
    config = with_overrides(
        SidecarConfig(), batching={"attention_weight": 0.0}, accounting={"model": "qwen3-0.6b"}
    )
    assert config.step_config().attention_weight == 0.0
    # The step's compute figures are still counted in the model's FLOPs.
    assert config.step_config().compute_weight == model_attention_weight("qwen3-0.6b")
    assert "\nattention_weight = 0.0\n" in dump_config(config, "toml")
    with pytest.raises(ValueError, match=r"\[batching\] attention_weight: must be >= 0, or -1"):
        with_overrides(SidecarConfig(), batching={"attention_weight": -0.5})


def test_sections_map_onto_the_scheduling_core_configs() -> None:
    config = with_overrides(
        SidecarConfig(),
        batching={"token_budget": 1000, "world_size": 3, "attention_weight": 0.5},
        advantages={"mode": "constant", "scale": 4.0, "drop_zero_advantage": True},
        curriculum={"estimator": "beta", "low": 0.1, "high": 0.9, "revisits": 2, "seed": 5},
    )
    assert config.step_config() == StepConfig(
        token_budget=1000,
        world_size=3,
        attention_weight=0.5,
        compute_weight=model_attention_weight(config.accounting.model),
        advantage_mode="constant",
        advantage_scale=4.0,
        drop_zero_advantage=True,
    )
    assert config.curriculum.curriculum_config() == CurriculumConfig(
        estimator="beta", low=0.1, high=0.9, revisits=2
    )
